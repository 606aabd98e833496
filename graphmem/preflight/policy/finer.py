"""Inside the checkpointed blocks: which ops' outputs could be kept, op by op, and what each saves.

Input: an analysed training step (``ModeReport``) with some blocks checkpointed, the blocks' module
paths, and the choice (each block's variant).  Output: ``Keepable`` items, one per block, submodule
and kind of op (``attn.proj:matmuls``, ``attention``, ``aten.convolution``): the FLOPs its ops
recompute (both recorded iterations) and the bytes their outputs take (one iteration), best
FLOPs per byte first.  Pure.

Keeping an op's output (selective checkpointing's MUST_SAVE) spares recomputing that op, and holds
its output from the forward to the block's backward.  ``search.py`` adds such items to the chosen
blocks while the budget leaves room, each step verified by an analysis (a greedy refinement of the
per-block optimum, not an optimum over every op: the per-block program would need a recording for
every pair of per-op variants).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from graphmem.memory.results import ModeReport

__all__ = ["Keepable", "keepable"]


@dataclass(frozen=True, slots=True)
class Keepable:
    """Ops of one block that could keep their outputs: ``name`` as ``--checkpoint-save`` takes it
    (``PATH:KIND``, or ``KIND`` for ops of the block itself)."""

    block: int
    name: str
    flops: int
    nbytes: int
    cost: int = 0  # what its recompute costs by the plan's cost model (costs.py)


@functools.cache
def _kinds() -> dict[str, str]:
    """Each matmul's and attention kernel's aten name (``aten.mm``) -> what ``--checkpoint-save`` calls it."""
    from graphmem.trace.rules import ops

    return {**{str(p): "matmuls" for p in ops.MATMULS}, **{str(p): "attention" for p in ops.ATTENTION}}


def _kind(op: str) -> str:
    """``matmuls``, ``attention`` or the aten op (``aten.convolution``) of a recorded op name."""
    packet = op.rsplit(".", 1)[0] if op.count(".") == 2 else op
    return _kinds().get(packet, packet)


def _block_of(module: str, paths: Sequence[str]) -> tuple[int, str] | None:
    """(block, the submodule path inside it) of a module path, or None outside every block."""
    for index, path in enumerate(paths):
        if module == path:
            return index, ""
        if module.startswith(path + "."):
            return index, module[len(path) + 1:]
    return None


def keepable(mode: ModeReport, paths: Sequence[str], choice: Sequence[int], costs: Sequence[int] | None = None
             ) -> list[Keepable]:
    """The items of the checkpointed blocks of ``choice`` whose recompute costs FLOPs, the most
    cost per byte first (then the most cost, then the block and name); ``costs``: each op's, by
    the plan's cost model (None: its FLOPs)."""
    sizes = {s.sid: s.nbytes for s in mode.trace.storages}
    flops: dict[tuple[int, str], int] = defaultdict(int)
    cost: dict[tuple[int, str], int] = defaultdict(int)
    per_op = costs if costs is not None else [op.flops for op in mode.trace.ops]
    nbytes: dict[tuple[int, str, int], int] = defaultdict(int)
    for op, op_cost in zip(mode.trace.ops, per_op, strict=True):
        if not op.recompute or not op.flops:
            continue
        found = _block_of(op.module, paths)
        if found is None or not choice[found[0]]:
            continue
        block, inside = found
        kind = _kind(op.op)
        if kind not in ("matmuls", "attention") and not kind.startswith("aten."):
            continue  # another library's op: --checkpoint-save names aten ops only
        key = (block, f"{inside}:{kind}" if inside else kind)
        flops[key] += op.flops
        cost[key] += op_cost
        nbytes[(*key, op.iteration)] += sum(sizes.get(sid, 0) for sid in op.outputs)
    items = [Keepable(block, name, total, max(b for (k, n, _), b in nbytes.items() if (k, n) == (block, name)),
                      cost[block, name]) for (block, name), total in flops.items()]
    return sorted(items, key=lambda i: (-i.cost / max(i.nbytes, 1), -i.cost, i.block, i.name))
