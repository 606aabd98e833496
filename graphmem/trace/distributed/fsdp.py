"""FSDP2 on fakes: the units ``fully_shard`` shards, its construction and its storage resizes.

FSDP2 frees and regrows the unsharded parameters by resizing their storages
(``_fsdp_param.alloc_storage`` / ``free_storage``), outside the dispatcher; both are wrapped to
tell the recorder, which ends the storage's old lifetime and starts a new one with the new size.
The first FSDP (``FullyShardedDataParallel``, which a program may build) resizes its flat
parameters the same way (``_flat_param._alloc_storage`` / ``_free_storage``), followed alike.

Input: a model whose parameters are fake, a ``ParallelSpec`` and the device mesh.  Output: the
model sharded in place by ``fully_shard`` (its units, then the root) and lazily initialised
as part of construction; the resizes, told to a callback while they happen.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import (
    fsdp1_handle,
    fsdp1_local_shard,
    fsdp1_reshard,
    fsdp1_runtime,
    fsdp1_sharded_views_skipped,
    fsdp_lazy_init,
    fsdp_storage_modules,
    local_tensor,
    storage_key,
)
from graphmem.errors import UserInputError
from graphmem.job.option import spelling
from graphmem.job.parallel import ParallelSpec
from graphmem.job.spec import parse_dtype
from graphmem.patching import patched

__all__ = ["finer_units", "following_resizes", "fsdp_units"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def fsdp_units(model: nn.Module, spec: ParallelSpec) -> tuple[str, ...]:
    """The classes FSDP2 shards as units: ``spec.units``, else the model's own
    ``_no_split_modules`` (transformers), else the class of the largest repeated child list."""
    present = {type(m).__name__ for m in model.modules()}
    if spec.units:
        missing = sorted(set(spec.units) - present)
        if missing:
            raise UserInputError(f"{spelling('fsdp_units')}: no module of class {', '.join(missing)} in the model; "
                                 f"its classes are: {', '.join(sorted(present))}")
        return spec.units
    declared = tuple(name for name in getattr(model, "_no_split_modules", None) or () if name in present)
    if declared:
        return declared
    best: tuple[int, str] | None = None
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        names = {type(c).__name__ for c in children}
        if len(children) >= 2 and len(names) == 1 and not isinstance(children[0], _CONTAINERS):
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, names.pop())
    return (best[1],) if best else ()


def finer_units(model: nn.Module, units: tuple[str, ...]) -> tuple[str, ...]:
    """Classes that split each of the units in two or more finer FSDP2 units: the classes of the
    units' children holding a tenth or more of their unit's parameters (a decoder layer's attention
    and MLP), the rest of the units' parameters going to the root.  () where a unit has fewer than
    two such children, a child is a container, or a module of those classes lies outside the units,
    holds another of them, or shares a parameter with a module outside it (tied weights)."""
    blocks = [m for m in model.modules() if type(m).__name__ in units and m is not model]
    classes: set[str] = set()
    for block in blocks:
        total = sum(p.numel() for p in block.parameters())
        big = [c for c in block.children() if total and 10 * sum(p.numel() for p in c.parameters()) >= total]
        if len(big) < 2 or any(isinstance(c, _CONTAINERS) for c in big):
            return ()
        classes.update(type(c).__name__ for c in big)
    inside = {id(m) for block in blocks for m in block.modules()}
    finer = [m for m in model.modules() if type(m).__name__ in classes]
    if not finer or classes & set(units) or any(id(m) not in inside for m in finer) \
            or any(type(d).__name__ in classes for m in finer for d in list(m.modules())[1:]):
        return ()
    names: dict[int, list[str]] = {}  # each parameter: every name the model reaches it by
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for path, module in model.named_modules(remove_duplicate=False):
        if type(module).__name__ in classes and any(not n.startswith(f"{path}.") for p in module.parameters()
                                                    for n in names[id(p)]):
            return ()  # a parameter (or the module itself) is reached from outside it too
    return tuple(sorted(classes, key=[type(m).__name__ for m in finer].index))


def _initialise_fsdp(model: nn.Module) -> None:
    """Run FSDP2's lazy initialisation now, as part of construction, not in the first forward.

    It re-pads a rank's local shard unless it already is a view of the padded shard, which it
    checks by ``data_ptr()``: fake tensors have none, so on ranks with uneven shards it would
    copy every parameter in the recorded forward where the real run copies nothing.  Done
    here, the copy replaces the shard before the step, as the real one is.
    """
    state = getattr(model, "_get_fsdp_state", None)
    if callable(state):
        fsdp_lazy_init(state())


def _fully_shard(model: nn.Module, spec: ParallelSpec, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    units = fsdp_units(model, spec)
    policy = MixedPrecisionPolicy(
        param_dtype=parse_dtype(spec.param_dtype) if spec.param_dtype else None,
        reduce_dtype=parse_dtype(spec.reduce_dtype) if spec.reduce_dtype else None)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": spec.reshard_after_forward, "mp_policy": policy}
    modules = [m for m in model.modules() if type(m).__name__ in units and m is not model]
    past = [i for i in spec.keep_units if i >= len(modules)]
    if past:
        raise UserInputError(f"{spelling('fsdp_keep_units')}: no unit {', '.join(map(str, past))}; the model has "
                             f"{len(modules)} "
                             f"FSDP2 units ({', '.join(units)}: 0 to {len(modules) - 1})")
    for index, module in enumerate(modules):
        fully_shard(module, **{**kwargs, **({"reshard_after_forward": False} if index in spec.keep_units else {})})
    fully_shard(model, **kwargs)
    return model


@contextlib.contextmanager
def following_resizes(resized: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call ``resized(tensor)`` after every storage resize FSDP2 or the first FSDP makes
    (alloc/free of the unsharded parameters), while inside, with the first FSDP's checks by
    data pointer made on fakes as on real tensors (``_fsdp1_pointer_checks``); FSDP2's warning
    that a unit returned a view is not shown (it fires for every unit whose output is a Linear's
    over 3-D input, once per recording)."""
    modules = fsdp_storage_modules()
    if not modules:  # no FSDP in this torch: nothing resizes
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        with _resizes_told(modules, resized):
            yield


@contextlib.contextmanager
def _resizes_told(modules: Any, resized: Callable[[torch.Tensor], None]) -> Iterator[None]:
    originals = {(m, name): getattr(m, name) for m in modules for name in _RESIZES if hasattr(m, name)}

    def wrap(original: Callable[..., None]) -> Callable[..., None]:
        def run(tensor: torch.Tensor, *size: Any) -> None:
            original(tensor, *size)
            resized(tensor)
        return run

    with patched(*((module, name, wrap(original)) for (module, name), original in originals.items()),
                 *_fsdp1_pointer_checks(modules)):
        yield


def _fsdp1_pointer_checks(modules: Any) -> list[tuple[Any, str, Any]]:
    """The first FSDP's checks by ``data_ptr()`` (every fake tensor's is 0), made by the
    storages' identities, offsets and sizes instead: whether two tensors share a storage (else
    it would find a parameter's own storage in its flat parameter and never copy an edited one
    back), whether a storage is allocated (else it refuses to write parameters back when it
    keeps them unsharded after forward, as SHARD_GRAD_OP does) and whether a unit was already
    resharded after backward (else it would never reshard one whose output did not reach the
    loss)."""
    flat = next((m for m in modules if hasattr(m, "_same_storage")), None)
    if flat is None:
        return []
    runtime = fsdp1_runtime()

    def catch_all_reshard(state: Any) -> None:
        handle = fsdp1_handle(state)
        if handle is None:
            return
        param = handle.flat_param
        shard = fsdp1_local_shard(param)
        if _same_storage(param, shard) and param.storage_offset() == shard.storage_offset() \
                and not fsdp1_sharded_views_skipped(handle):
            return  # already resharded
        fsdp1_reshard(state, handle)

    return [(flat, "_same_storage", _same_storage), (flat, "_data_ptr_allocated", _allocated),
            (runtime, "_catch_all_reshard", catch_all_reshard)]


# FSDP2's functions that resize a storage, and the first FSDP's (the flat parameters')
_RESIZES = ("alloc_storage", "free_storage", "_alloc_storage", "_free_storage")


def _allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors (or the local tensors of DTensors) share a storage."""
    return storage_key(local_tensor(a))[0] == storage_key(local_tensor(b))[0]
