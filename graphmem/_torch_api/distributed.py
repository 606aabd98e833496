"""torch.distributed's internals: the fake process group, FSDP2's and the first FSDP's, DTensor's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from graphmem._torch_api.fakes import unset_fake_temporarily

__all__ = ["dtensor_sharding_fakes_on", "fake_process_group_store", "fsdp1_handle", "fsdp1_local_shard",
           "fsdp1_reshard", "fsdp1_runtime", "fsdp1_sharded_views_skipped", "fsdp_lazy_init", "fsdp_storage_modules",
           "local_tensor", "meshes_made_for_real", "process_group_sizes", "strided_shards_indexed_for_real"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor behind a DTensor (its storage is what the rank holds); ``t`` otherwise."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def fake_process_group_store() -> Any:
    """The store of torch's fake process group ("fake" backend: collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def fsdp_storage_modules() -> tuple[Any, ...]:
    """The modules of FSDP2 (``alloc_storage``/``free_storage``) and of the first FSDP
    (``_alloc_storage``/``_free_storage``, its flat parameters) whose functions resize the
    unsharded parameters' storages (none in a torch without them)."""
    modules: list[Any] = []
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
        modules += [_fsdp_param, _fsdp_param_group]
    except ImportError:
        pass
    try:
        from torch.distributed.fsdp import _flat_param
        modules.append(_flat_param)
    except ImportError:
        pass
    return tuple(modules)


def fsdp1_runtime() -> Any:
    """The first FSDP's runtime module (its hooks' reshard after backward)."""
    from torch.distributed.fsdp import _runtime_utils

    return _runtime_utils


def process_group_sizes() -> list[int]:
    """The size of every process group torch.distributed holds now (the default one included)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return []
    return [group.size() for group in dist.distributed_c10d._world.pg_map]


@contextlib.contextmanager
def dtensor_sharding_fakes_on(device: torch.device) -> Iterator[None]:
    """DTensor's sharding propagation runs an op on fake tensors it makes from the arguments'
    specs, on the mesh's device type (``_op_schema._rebuild_tensor_from_dtensor_meta``), to learn
    the output's shape, strides and dtype; inside, they are made on ``device`` instead: on a
    CPU-only torch a fake CUDA tensor cannot take some ops (``copy_``, the ``uniform_`` that
    initialises a sharded parameter: "PyTorch is not linked with support for cuda devices")."""
    try:
        from torch.distributed.tensor import _op_schema
    except ImportError:  # a torch without DTensor has nothing to propagate
        yield
        return
    original = getattr(_op_schema, "_rebuild_tensor_from_dtensor_meta", None)
    if original is None:
        yield
        return

    def rebuilt(arg: Any) -> Any:
        if arg.tensor_meta is None:
            return original(arg)  # torch's own error
        meta = arg.tensor_meta
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)

    _op_schema._rebuild_tensor_from_dtensor_meta = rebuilt
    try:
        yield
    finally:
        _op_schema._rebuild_tensor_from_dtensor_meta = original


def fsdp_lazy_init(state: Any) -> None:
    """FSDP2's lazy initialisation of a module's state (``_get_fsdp_state()``), run now."""
    state._lazy_init()


def fsdp1_handle(state: Any) -> Any:
    """The first FSDP's handle of a module's flat parameter (None where it has none)."""
    return state._handle


def fsdp1_local_shard(flat_param: Any) -> torch.Tensor:
    """The rank's own shard of the first FSDP's flat parameter."""
    shard: torch.Tensor = flat_param._local_shard
    return shard


def fsdp1_sharded_views_skipped(handle: Any) -> bool:
    """Whether the first FSDP's handle skipped pointing its parameters at the sharded views."""
    skipped: bool = handle._skipped_use_sharded_views
    return skipped


def fsdp1_reshard(state: Any, handle: Any) -> None:
    """The first FSDP's reshard of ``handle`` after backward, freeing the unsharded flat
    parameter where its runtime would (``_should_free_in_backward``)."""
    runtime = fsdp1_runtime()
    runtime._reshard(state, handle, runtime._should_free_in_backward(state, handle))


@contextlib.contextmanager
def meshes_made_for_real() -> Iterator[None]:
    """FSDP2 on a tensor-parallel model joins the two meshes (DeviceMesh._concatenate), which
    indexes a small real tensor of ranks: outside the fake mode."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__.get("_concatenate")
    if original is None:
        yield
        return
    function = original.__func__ if isinstance(original, staticmethod) else original

    def concatenate(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return function(*args, **kwargs)

    DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh._concatenate = original  # type: ignore[method-assign]


@contextlib.contextmanager
def strided_shards_indexed_for_real(quiet: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
    """Which rows of a dimension a rank holds under a ``_StridedShard`` placement (FSDP2 over
    tensor parallelism) is worked out from a real ``torch.arange`` of the dimension, split and
    read back (``local_shard_size_and_offset``): outside the fake mode and unrecorded, as in a
    real run.  DTensor's random ops on a GPU mesh ask it (the RNG offsets of ``trunc_normal_``
    on such a parameter, ``OffsetBasedRNGTracker``); a fake holds no indices to read."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # a torch without it has nothing to index
        yield
        return
    original = _StridedShard.__dict__.get("local_shard_size_and_offset")
    if original is None:
        yield
        return

    def local_shard_size_and_offset(self: Any, *args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily(), quiet():
            return original(self, *args, **kwargs)

    _StridedShard.local_shard_size_and_offset = local_shard_size_and_offset  # type: ignore[method-assign]
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = original  # type: ignore[method-assign]
