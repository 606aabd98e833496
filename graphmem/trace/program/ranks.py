"""One rank of a program launched as ``torchrun --nproc-per-node N`` would launch it.

Input: the ``Program`` and the rank.  Output: ``as_rank``, a context manager under which a
program launched by torchrun (``--nproc-per-node``, one process too) sees torchrun's
environment for that rank (RANK, LOCAL_RANK, WORLD_SIZE, ...), and
``torch.distributed.init_process_group`` (any backend, any init method) starts torch's fake
process group of N ranks as that rank: collectives move nothing and wait for no one, and
PyTorch's own engines (DDP, FSDP2, DeviceMesh, tensor parallel) run on it as under ``analyze
--parallel``.  The process group is destroyed on exit if the program left it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from graphmem._torch_api import (
    fake_process_group_store,
    process_group_sizes,
    strided_shards_indexed_for_real,
    unset_fake_temporarily,
)
from graphmem.errors import UnsupportedError
from graphmem.job.fake_gpu import gpus_on_the_node
from graphmem.job.program import Program
from graphmem.patching import environment, patched, replaced_everywhere
from graphmem.trace.distributed import ddp_on_fakes, following_resizes

__all__ = ["as_rank"]


@contextlib.contextmanager
def _meshes_made_for_real(quiet: Callable[[], AbstractContextManager[Any]],
                          held: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """``init_device_mesh`` outside the fake mode and unrecorded (``quiet``), as analyze makes
    its meshes: the mesh's rank tensor holds real values (which rank sits where), the rest of
    the program's tensors are fakes.  The rank tensor is then ``held``: a real CPU tensor the
    program keeps."""
    from torch.distributed import device_mesh

    original = device_mesh.init_device_mesh

    def init_device_mesh(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily(), quiet():
            mesh = original(*args, **kwargs)
        held(mesh.mesh)
        return mesh

    # every name it is bound to: FSDP2's default mesh calls the one torch.distributed.tensor imported
    with replaced_everywhere({original: init_device_mesh}, ("init_device_mesh",)):
        yield


class _HeldWork:
    """A point-to-point message's request that holds its tensor until it is dropped, as gloo's
    and NCCL's requests do (the fake process group's holds none): a pipeline schedule keeps
    its forward sends' requests until the step's backward, and with them the activations sent."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self._work, self._tensor = work, tensor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def _requests_holding_tensors() -> Iterator[None]:
    """``isend`` and ``irecv`` return requests that hold their tensor (``_HeldWork``)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def holding(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            work = original(tensor, *args, **kwargs)
            return None if work is None else _HeldWork(work, tensor)
        return call

    isend, irecv = holding(c10d.isend), holding(c10d.irecv)
    with patched((c10d, "isend", isend), (dist, "isend", isend), (c10d, "irecv", irecv), (dist, "irecv", irecv)):
        yield


@contextlib.contextmanager
def _objects_each_rank_keeps(world: int) -> Iterator[None]:
    """Python objects exchanged between ranks (``broadcast_object_list``, ``all_gather_object``,
    ``gather_object``): each rank is recorded alone, so the others' objects are not here; every
    rank is taken to hold what this one holds (a broadcast leaves each rank its own object,
    which programs compute alike on every rank: a run's name, a random value, a flag).  The fake process
    group's invented bytes would not unpickle (Lightning's DDP broadcast failed with EOFError)."""
    import torch.distributed as dist

    def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                              device: Any = None, group_src: int | None = None) -> None:
        return None

    def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
        object_list[:] = [obj] * len(object_list or range(world))

    def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                      group: Any = None, group_dst: int | None = None) -> None:
        if object_gather_list is not None:
            object_gather_list[:] = [obj] * len(object_gather_list or range(world))

    table = {dist.broadcast_object_list: broadcast_object_list, dist.all_gather_object: all_gather_object,
             dist.gather_object: gather_object}
    with replaced_everywhere(table, ("broadcast_object_list", "all_gather_object", "gather_object")):
        yield


@contextlib.contextmanager
def as_rank(program: Program, rank: int, gpu: bool, resized: Callable[[torch.Tensor], None],
            quiet: Callable[[], AbstractContextManager[Any]], held: Callable[[torch.Tensor], None],
            groups: list[int] | None = None) -> Iterator[None]:
    """Run the program (inside) as global ``rank`` of ``program.world_size``; ``gpu``: its "cuda"
    is a GPU (then ``torch.cuda.device_count()`` is the node's ``nproc_per_node``); ``resized(t)``: FSDP2 resized
    ``t``'s storage, ``quiet()``: the recorder records nothing inside, ``held(t)``: a real
    tensor the program holds from now on (the recorder's); ``groups``: told the size of each
    process group the program made, at the end (NCCL holds a communicator for each)."""
    world = program.world_size
    if not program.launched:  # python's one process: no torchrun environment, the program's own init
        yield
        return
    import torch.distributed as dist

    if not dist.is_available():
        raise UnsupportedError("this torch build has no torch.distributed; --nproc-per-node needs it")
    if dist.is_initialized():
        raise UnsupportedError("a torch.distributed process group is already initialised in this process; "
                               "graphmem run starts the program's own")
    start = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:  # the program's backend and rendezvous: ours
        start("fake", store=fake_process_group_store(), rank=rank, world_size=world)

    # the fake GPU's node (graphmem.job.fake_gpu): torch.cuda's, torch.accelerator's and torch's C hooks' count
    node = gpus_on_the_node(program.nproc_per_node) if gpu else contextlib.nullcontext()
    with environment(program.rank_environment(rank)), node, ddp_on_fakes(world), following_resizes(resized), \
            _meshes_made_for_real(quiet, held), strided_shards_indexed_for_real(quiet), _requests_holding_tensors(), \
            _objects_each_rank_keeps(world), \
            replaced_everywhere({start: init_process_group}, ("init_process_group",)):  # DeviceMesh's own name too
        try:
            yield
        finally:
            if groups is not None:
                groups.extend(process_group_sizes())
            if dist.is_initialized():
                dist.destroy_process_group()
