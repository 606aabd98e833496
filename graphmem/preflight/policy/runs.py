"""A recorded step cut into runs: maximal stretches of consecutive ops inside one block (one
module of the checkpointed class) or outside every block.

Input: a ``Trace`` and the module paths of the blocks, in the model's order.  Output: ``Runs``:
each run's block (None outside), its first op and the op after its last, its phase and
iteration; and each op's run.  Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from graphmem.records import Trace

__all__ = ["Run", "Runs", "block_of", "cut_runs"]


@dataclass(frozen=True, slots=True)
class Run:
    """Ops ``start`` to ``stop - 1`` of a trace, all in ``block`` (None: outside every block)."""

    block: int | None
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Runs:
    """A trace cut into runs; ``run_of[i]`` is the run of op ``i``."""

    runs: tuple[Run, ...]
    run_of: tuple[int, ...]

    @property
    def blocks(self) -> tuple[int | None, ...]:
        """Each run's block: two recordings line up when these are equal."""
        return tuple(run.block for run in self.runs)


def block_of(path: str, blocks: Sequence[str]) -> int | None:
    """The block a module path lies in: 2 for ``layers.2.mlp`` with blocks ``layers.0``, ...;
    None outside every block."""
    for index, block in enumerate(blocks):
        if path == block or path.startswith(block + "."):
            return index
    return None


def _labels(trace: Trace, blocks: Sequence[str]) -> list[int | None]:
    """Each op's block.  Ops outside every block between two ops of one block, or of two
    neighbouring blocks, in one phase of one iteration, are the later block's: code the block
    runs outside its module tree (transformers' rotary helpers, recorded under ``Func``; the
    residual stream's gradient summed between two blocks' backwards)."""
    labels = [block_of(op.module, blocks) for op in trace.ops]
    keys = [(op.phase, op.iteration) for op in trace.ops]
    start = 0
    while start < len(labels):
        if labels[start] is not None:
            start += 1
            continue
        stop = start
        while stop < len(labels) and labels[stop] is None:
            stop += 1
        before = labels[start - 1] if start > 0 else None
        after = labels[stop] if stop < len(labels) else None
        if before is not None and after is not None and abs(before - after) <= 1 \
                and len(set(keys[start - 1:stop + 1])) == 1:
            labels[start:stop] = [after] * (stop - start)
        start = stop
    return labels


def cut_runs(trace: Trace, blocks: Sequence[str]) -> Runs:
    """``trace`` cut into runs of ``blocks`` (module paths, in the model's order)."""
    runs: list[Run] = []
    run_of: list[int] = []
    for index, label in enumerate(_labels(trace, blocks)):
        if runs and runs[-1].block == label:
            runs[-1] = Run(label, runs[-1].start, index + 1)
        else:
            runs.append(Run(label, index, index + 1))
        run_of.append(len(runs) - 1)
    return Runs(tuple(runs), tuple(run_of))
