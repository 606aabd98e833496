"""Event sequences for the allocator stage: extra allocations in, per-op peaks out (pure).

Input: the alloc/free sequence of stage 3b (``graphmem.memory.memory_events``) and the
allocations the graph does not show (kernel scratch, library workspaces).  Output: the merged
sequence that ``graphmem.cuda.allocator.replay`` takes, and ``per_step_peaks`` to fold a replay's
per-event timeline back onto the recorded ops.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from graphmem.cuda.allocator import MemoryEvent
from graphmem.records import OpRecord

__all__ = ["ExtraAllocation", "per_step_peaks", "scratch_allocations", "with_extra_allocations"]


@dataclass(frozen=True, slots=True)
class ExtraAllocation:
    """An allocation the graph does not show, made during op ``step`` after its outputs.

    ``persistent=False``: kernel scratch, freed when the op ends.  ``True``: kept to the end
    of the run, like the cuBLAS workspace of a (handle, stream).
    """

    step: int
    nbytes: int
    sid: int
    persistent: bool = False


def scratch_allocations(ops: Iterable[OpRecord]) -> list[ExtraAllocation]:
    """Each op's scratch bytes (from the rules) as an allocation freed when the op ends; sid
    ``-1 - op index`` so it never collides with a storage id."""
    return [ExtraAllocation(op.index, op.scratch_bytes, -1 - op.index) for op in ops if op.scratch_bytes]


def with_extra_allocations(events: Iterable[MemoryEvent], extras: Iterable[ExtraAllocation]
                           ) -> tuple[MemoryEvent, ...]:
    """Insert allocations the graph does not show into an event sequence.

    Each extra of op ``step`` comes after that op's own allocations (its outputs exist
    before its kernel asks for scratch) and before the releases that follow the op; a
    non-persistent one is freed right after it is allocated.

    Args:
        events: the sequence from ``memory_events`` (allocs of a step before its frees).
        extras: the allocations to insert; sids must not collide with storage ids.

    Returns:
        The merged sequence.
    """
    pending = sorted(extras, key=lambda extra: extra.step)
    merged: list[MemoryEvent] = []
    position = 0
    # emit each event, first flushing the extras whose op is over
    for event in events:
        while position < len(pending) and _before(pending[position], event):
            merged += _extra_events(pending[position])
            position += 1
        merged.append(event)
    for extra in pending[position:]:
        merged += _extra_events(extra)
    return tuple(merged)


def _before(extra: ExtraAllocation, event: MemoryEvent) -> bool:
    return extra.step < event.step or (extra.step == event.step and event.kind == "free")


def _extra_events(extra: ExtraAllocation) -> list[MemoryEvent]:
    alloc = MemoryEvent("alloc", extra.sid, extra.nbytes, extra.step)
    return [alloc] if extra.persistent else [alloc, MemoryEvent("free", extra.sid, extra.nbytes, extra.step)]


def per_step_peaks(timeline: Sequence[int], events: Sequence[MemoryEvent], num_ops: int) -> tuple[int, ...]:
    """The highest value of an event timeline while each op runs (index i: op i).

    Args:
        timeline: a value after each event (``AllocatorStats.allocated_timeline`` or
            ``reserved_timeline``), aligned with ``events``.
        events: the replayed sequence, steps non-decreasing; step -1 counts as op 0.
        num_ops: the number of recorded ops.

    Returns:
        Per op: the larger of the value when it starts and the values after its events.
    """
    peaks: list[int] = []
    index, value = 0, 0
    # walk the ops in order, consuming the events of each
    for op in range(num_ops):
        peak = value
        while index < len(events) and max(events[index].step, 0) <= op:
            value = timeline[index]
            peak = max(peak, value)
            index += 1
        peaks.append(peak)
    return tuple(peaks)

