"""Which ranks' memory can differ, read off the parameters' shapes (nothing is traced).

Input: a model and a ``ParallelSpec``.  Output: the distinct ranks (a representative rank and
every rank it stands for), and ZeroRedundancyOptimizer's partition of the parameters.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from graphmem.job.parallel import ParallelSpec
from graphmem.trace.distributed.tensor_parallel import tp_plan

__all__ = ["distinct_ranks", "zero_partition"]


def _fsdp_signature(model: nn.Module, spec: ParallelSpec, rank: int) -> tuple[int, ...]:
    """Rows of every parameter this rank holds under FSDP2's dim-0 sharding (equal tuples: equal ranks)."""
    shards = spec.degree("fsdp")
    index = rank % shards  # the mesh is (replicate, shard): the shard index is the fast one
    rows = []
    for p in model.parameters():
        dim0 = p.shape[0] if p.dim() else 1
        chunk = -(-dim0 // shards)
        rows.append(max(0, min(chunk, dim0 - index * chunk)))
    return tuple(rows)


def zero_partition(model: nn.Module, world_size: int) -> list[list[int]]:
    """The trainable parameters (indices, in order) whose optimizer state each rank holds."""
    return _zero_partition([p.numel() for p in model.parameters() if p.requires_grad], world_size)


def _tp_signature(model: nn.Module, spec: ParallelSpec, index: int) -> tuple[int, ...]:
    """Elements of every parameter a tensor-parallel rank holds (torch.chunk's split of the
    sharded dimension: colwise shards dim 0, rowwise dim 1 of a Linear weight)."""
    tp = spec.degree("tp")
    root, plan = tp_plan(model, spec)
    sizes = []
    for name, module in root.named_modules():
        style = next((v for k, v in plan.items() if fnmatch.fnmatch(name, k)), None)
        if not isinstance(style, str) or style == "sequence_parallel":
            continue
        for pname, p in module.named_parameters(recurse=False):
            if style.startswith("rowwise") and pname == "bias":
                sizes.append(p.numel())  # replicated
                continue
            dim = 0 if style.startswith("colwise") else 1
            n = p.shape[dim] if p.dim() > dim else 1
            chunk = -(-n // tp)
            sizes.append(max(0, min(chunk, n - index * chunk)) * (p.numel() // max(n, 1)))
    return tuple(sizes)


def _zero_partition(sizes: list[int], world_size: int) -> list[list[int]]:
    """ZeroRedundancyOptimizer's partition: parameters sorted by size, largest first, each to
    the rank holding the fewest elements so far (ties: the lowest rank); indices per rank."""
    loads = [0] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        parts[rank].append(i)
        loads[rank] += sizes[i]
    return parts


def distinct_ranks(model: nn.Module, spec: ParallelSpec) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The ranks whose memory can differ: (a representative rank, every rank it stands for).

    FSDP2 ranks differ by their shards' rows (uneven dim 0); ZeroRedundancyOptimizer's by the
    parameters whose state they hold; DDP's ranks are alike.
    """
    world = spec.world_size
    tp = spec.degree("tp")
    if tp > 1:  # rank = dp index x tp + tp index
        keys: list[Any] = [(_fsdp_signature(model, spec, r // tp) if spec.shards else (),
                            _tp_signature(model, spec, r % tp)) for r in range(world)]
    elif spec.shards:
        keys = [_fsdp_signature(model, spec, r) for r in range(world)]
    elif spec.pipelined:  # every stage holds other blocks
        keys = list(range(world))
    elif "zero1" in dict(spec.degrees):
        params = [p for p in model.parameters() if p.requires_grad]
        parts = _zero_partition([p.numel() for p in params], world)
        keys = [tuple(sorted(tuple(params[i].shape) for i in part)) for part in parts]
    else:
        keys = [()] * world
    groups: dict[Any, list[int]] = {}
    for rank, key in enumerate(keys):
        groups.setdefault(key, []).append(rank)
    return tuple((ranks[0], tuple(ranks)) for ranks in groups.values())
