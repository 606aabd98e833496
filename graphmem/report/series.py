"""Stage 4 helpers: series over the op sequence, shared by the pictures.

Input: one ModeReport (its trace's ops and its lifetimes).
Output: the mode a picture draws, the phase spans (forward / loss / backward / optimizer
per iteration), live bytes per category after every op, the storages live after an op,
and peak-preserving downsamplings for graphs of tens of thousands of ops: the highest op
of each run (``bucket_peaks``) and of each pixel column of a drawing (``column_peaks``).
Pure functions; no plotting library is imported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from graphmem.memory.mode_report import coverage
from graphmem.memory.results import Category, Lifetime, MemoryReport, ModeReport
from graphmem.records import OpRecord

__all__ = ["Column", "PhaseSpan", "bucket_peaks", "category_timelines", "column_peaks", "drawn_mode", "live_at",
           "phase_spans"]


@dataclass(frozen=True, slots=True)
class PhaseSpan:
    """A run of consecutive ops of one phase in one iteration (op indices, inclusive)."""

    phase: str
    iteration: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a drawing: x from ``start`` to ``end`` in op units (op i spans i - 0.5
    to i + 0.5), drawn at the value of op ``op``, the highest op it overlaps."""

    start: float
    end: float
    op: int


def drawn_mode(report: MemoryReport) -> ModeReport:
    """The mode the pictures and per-module tables show: training when analysed, else
    inference, else (--generate) the decode trace, which fills the cache and decodes a token."""
    mode = report.train or report.inference or (report.generate.decode if report.generate else None)
    if mode is None:
        raise AssertionError("drawn_mode: the report holds neither a train nor an inference mode")
    return mode


def phase_spans(ops: Sequence[OpRecord]) -> tuple[PhaseSpan, ...]:
    """Split the op sequence into maximal runs of the same (phase, iteration)."""
    spans: list[PhaseSpan] = []
    for op in ops:
        last = spans[-1] if spans else None
        if last is not None and (last.phase, last.iteration) == (str(op.phase), op.iteration):
            spans[-1] = PhaseSpan(last.phase, last.iteration, last.start, op.index)
        else:
            spans.append(PhaseSpan(str(op.phase), op.iteration, op.index, op.index))
    return tuple(spans)


def category_timelines(mode: ModeReport) -> dict[Category, tuple[int, ...]]:
    """Live bytes after each op, per category (every category present); the op's scratch
    bytes count as temporaries.  Summed over categories this is ``mode.timeline``."""
    n = len(mode.trace.ops)
    series = {c: coverage([life for life in mode.lifetimes if life.category == c], n) for c in Category}
    for op in mode.trace.ops:
        series[Category.TEMPORARY][op.index] += op.scratch_bytes
    return {c: tuple(values) for c, values in series.items()}


def live_at(mode: ModeReport, step: int) -> tuple[Lifetime, ...]:
    """The lifetimes that cover op ``step`` (live after it), largest first, then by sid."""
    live = [life for life in mode.lifetimes if life.start <= step <= life.end]
    return tuple(sorted(live, key=lambda life: (-life.nbytes, life.sid)))


def bucket_peaks(values: Sequence[int], buckets: int) -> tuple[int, ...]:
    """Indices that keep the shape of ``values`` at ``buckets`` points: the index of the
    largest value in each of ``buckets`` equal runs (all indices when there are fewer).
    The global maximum is always kept, so a downsampled curve still reaches the peak."""
    n = len(values)
    if buckets <= 0:
        raise AssertionError(f"bucket_peaks: buckets must be positive, got {buckets}")
    if n <= buckets:
        return tuple(range(n))
    bounds = [round(i * n / buckets) for i in range(buckets + 1)]
    return tuple(max(range(lo, hi), key=values.__getitem__)
                 for lo, hi in pairwise(bounds) if hi > lo)


def column_peaks(values: Sequence[int], columns: int) -> tuple[Column, ...]:
    """``values`` (one per op) drawn ``columns`` columns wide, each column at the highest op
    that overlaps it (an op across a column edge counts in both), so the column holding the
    peak is drawn at the peak however narrow the peak op is.  One column per op when there
    are no more ops than columns."""
    n = len(values)
    if columns <= 0:
        raise AssertionError(f"column_peaks: columns must be positive, got {columns}")
    if n <= columns:
        return tuple(Column(i - 0.5, i + 0.5, i) for i in range(n))
    out = []
    # column j covers ops j*n/columns up to (j+1)*n/columns (exact integer bounds)
    for j in range(columns):
        first, last = j * n // columns, -(-(j + 1) * n // columns) - 1
        best = max(range(first, last + 1), key=values.__getitem__)
        out.append(Column(j * n / columns - 0.5, (j + 1) * n / columns - 0.5, best))
    return tuple(out)
