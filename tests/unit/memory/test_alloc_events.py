"""Inserting scratch/workspace allocations and folding timelines onto ops, by hand."""

from __future__ import annotations

from graphmem.cuda.allocator import MemoryEvent, replay
from graphmem.memory.alloc_events import ExtraAllocation, per_step_peaks, with_extra_allocations

MiB = 1 << 20


def alloc(sid: int, nbytes: int, step: int) -> MemoryEvent:
    return MemoryEvent("alloc", sid, nbytes, step)


def free(sid: int, nbytes: int, step: int) -> MemoryEvent:
    return MemoryEvent("free", sid, nbytes, step)


def test_scratch_goes_after_the_ops_outputs_and_before_its_releases() -> None:
    # op 0 allocates sid 2, then sid 2 is released after op 0; op 1 allocates sid 3.
    events = (alloc(1, 100, -1), alloc(2, 100, 0), free(2, 100, 0), alloc(3, 100, 1))
    extras = [ExtraAllocation(step=0, nbytes=4096, sid=-1),
              ExtraAllocation(step=1, nbytes=8 * MiB, sid=-2, persistent=True)]
    assert with_extra_allocations(events, extras) == (
        alloc(1, 100, -1), alloc(2, 100, 0),
        alloc(-1, 4096, 0), free(-1, 4096, 0),      # scratch: freed when op 0 ends
        free(2, 100, 0), alloc(3, 100, 1),
        alloc(-2, 8 * MiB, 1))                       # workspace: kept to the end


def test_extra_of_an_op_without_events_lands_between_its_neighbours() -> None:
    events = (alloc(1, 10, 0), alloc(2, 10, 5))
    merged = with_extra_allocations(events, [ExtraAllocation(step=3, nbytes=7, sid=-1)])
    assert merged == (alloc(1, 10, 0), alloc(-1, 7, 3), free(-1, 7, 3), alloc(2, 10, 5))


def test_scratch_raises_the_peak_but_not_the_end_state() -> None:
    # 1000 B output (1024 block) plus 3000 B scratch (3072 block) in op 0: peak 4096,
    # after the op only the output remains; all in one 2 MiB small segment
    events = with_extra_allocations([alloc(1, 1000, 0)], [ExtraAllocation(0, 3000, -1)])
    stats = replay(events)
    assert stats.allocated_timeline == (1024, 4096, 1024)
    assert stats.allocated_peak_bytes == 4096 and stats.reserved_peak_bytes == 2 * MiB


def test_per_step_peaks_by_hand() -> None:
    # events of steps -1, 0, 0, 2 (op 1 has none); timeline after each: 5, 9, 4, 6
    events = (alloc(1, 1, -1), alloc(2, 1, 0), free(2, 1, 0), alloc(3, 1, 2))
    # op 0: starts at 0, sees 5 (step -1 counts as op 0), 9, 4 -> 9; op 1: carries 4;
    # op 2: starts at 4, then 6 -> 6; op 3: carries 6
    assert per_step_peaks((5, 9, 4, 6), events, num_ops=4) == (9, 4, 6, 6)
