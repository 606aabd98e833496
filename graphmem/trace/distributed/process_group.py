"""The fake process group, and PyTorch's own engines applied in it to one rank's model.

``--parallel`` (graphmem.job.parallel) is applied to the fake model by the real
``DistributedDataParallel``, FSDP2 ``fully_shard`` and ``ZeroRedundancyOptimizer``, with
``torch.distributed`` initialised on PyTorch's fake backend (its collectives return at once
and touch no data) as one rank of ``world_size``.  The recorder then records that rank's step
like any other: the all-gathered parameters, the reduce-scatter inputs and the sharded
gradients and optimizer state are the engines' own tensors.  Construction (sharding the
parameters, allocating buckets) runs before the recorded step; what it leaves alive is live
from the first op on, what it frees is not counted.  What each engine does outside the
dispatcher, and how it is followed, is told in its own module (ddp.py, fsdp.py).

Input: a model whose parameters are fake, a ``ParallelSpec`` and the fake mode.  Output:
``Applied``, the model as the engines (or the user's own ``parallelize``) make it for one
rank, with the communication buffers construction left alive.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import (
    TorchDispatchMode,
    fake_process_group_store,
    local_tensor,
    meshes_made_for_real,
    storage_id,
    tree_flatten,
)
from graphmem.errors import UnsupportedError
from graphmem.job.option import spelling
from graphmem.job.parallel import ParallelSpec
from graphmem.trace.distributed.ddp import _ddp, _users_own
from graphmem.trace.distributed.fsdp import _fully_shard, _initialise_fsdp
from graphmem.trace.distributed.tensor_parallel import _tensor_parallel

__all__ = ["Applied", "apply_parallel", "fake_process_group", "meta_copy"]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int) -> Iterator[None]:
    """``torch.distributed`` initialised on the fake backend as ``rank`` of ``world_size``."""
    import torch.distributed as dist

    if not dist.is_available():
        raise UnsupportedError(f"this torch build has no torch.distributed; {spelling('parallel')} needs it")
    store = fake_process_group_store()  # importing it registers the "fake" backend
    if dist.is_initialized():
        raise UnsupportedError("a torch.distributed process group is already initialised in this process; "
                               f"{spelling('parallel')} runs its own fake one")
    dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Created(TorchDispatchMode):
    """Construction: every tensor the engines create, by weak reference."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.tensors.append(weakref.ref(t))
        return out

    def alive(self) -> list[torch.Tensor]:
        found = (ref() for ref in self.tensors)
        return [t for t in found if t is not None]


@dataclass(slots=True)
class Applied:
    """The model as the training loop calls it, and what construction left alive."""

    model: nn.Module                 # the module to call (DDP's wrapper, or the FSDP2 model)
    inner: nn.Module                 # the user's model, with its (sharded) parameters
    buffers: list[torch.Tensor]      # communication buffers the engines allocated (DDP's buckets)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no memory),
    for engines that change the module they are given (fully_shard changes its class)."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def apply_parallel(model: nn.Module, spec: ParallelSpec, fake_mode: Any) -> Applied:
    """Apply ``spec`` to ``model`` (whose parameters are fake; FSDP2 changes it: give it a
    ``meta_copy``) inside ``fake_mode``.

    Needs ``fake_process_group``.  The mesh is made before the fake mode is entered (it reads
    real values).
    """
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(name for name, _ in spec.degrees)
    created = _Created()
    mesh: Any = None
    tp_mesh: Any = None
    if spec.parallelize is not None:
        mesh = init_device_mesh("cpu", tuple(d for _, d in spec.degrees), mesh_dim_names=names)
        wrapped = _users_own(model, spec, mesh, fake_mode, created)
    else:
        if "tp" in names:
            two = init_device_mesh("cpu", (spec.degree("fsdp"), spec.degree("tp")), mesh_dim_names=("dp", "tp"))
            mesh, tp_mesh = (two["dp"] if spec.shards else None), two["tp"]
        elif spec.shards:
            replicate, shard = spec.degree("ddp"), spec.degree("fsdp")
            mesh = (init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
                    if replicate > 1 else init_device_mesh("cpu", (shard,)))
        with fake_mode, created, meshes_made_for_real():
            if tp_mesh is not None:
                _tensor_parallel(model, spec, tp_mesh)
            if spec.shards:
                wrapped = _fully_shard(model, spec, mesh)
            else:
                wrapped = model if tp_mesh is not None else _ddp(model, spec)
    with fake_mode, created:
        _initialise_fsdp(wrapped)
    # what construction allocated, still holds, and is no parameter or buffer: DDP's buckets
    own = {storage_id(local_tensor(t)) for t in [*model.parameters(), *model.buffers()]}
    buffers = [t for t in created.alive() if storage_id(t) not in own and t.untyped_storage().nbytes()]
    return Applied(model=wrapped, inner=model, buffers=buffers)
