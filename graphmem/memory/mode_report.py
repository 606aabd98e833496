"""Stage 3b: memory model.  Lifetimes -> ModeReport (pure).

Live bytes after every op are the bytes of every storage whose lifetime covers that op,
plus the op's own scratch bytes (from a per-op rule; zero where no rule applies).  The
target device here is the CPU allocator, which hands out exactly the bytes asked for (no
rounding, no caching), so a storage of N bytes costs N bytes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from itertools import accumulate

from graphmem.cuda.allocator import MemoryEvent
from graphmem.memory.attribution import charged_module
from graphmem.memory.results import Category, Lifetime, ModeReport, PeakInfo, PhasePeak
from graphmem.records import Phase, Trace

__all__ = ["build_mode_report", "compute_timeline", "coverage", "live_by_category", "parameter_step", "memory_events",
           "reference_steps", "ReferenceSteps"]


def coverage(lifetimes: Iterable[Lifetime], num_ops: int) -> list[int]:
    """Bytes of ``lifetimes`` live after each of ``num_ops`` ops (no scratch)."""
    delta = [0] * (num_ops + 2)
    # each lifetime adds its bytes from start to end; index shifted by one so start -1 fits
    for life in lifetimes:
        delta[life.start + 1] += life.nbytes
        delta[life.end + 2] -= life.nbytes
    return list(accumulate(delta))[1:num_ops + 1]


def compute_timeline(lifetimes: Iterable[Lifetime], trace: Trace) -> tuple[int, ...]:
    """Live bytes after each op of ``trace`` (index i = after op i), scratch included."""
    live = coverage(lifetimes, len(trace.ops))
    return tuple(b + op.scratch_bytes for b, op in zip(live, trace.ops, strict=True))


@dataclass(frozen=True, slots=True)
class ReferenceSteps:
    """The op indices totals are taken at: ``end_of_loss`` (last op before the first
    backward op), ``end_of_backward`` (last backward op; None without backward), ``end``."""

    end_of_loss: int
    end_of_backward: int | None
    end: int


def reference_steps(trace: Trace) -> ReferenceSteps:
    """Where activations, gradients and optimizer state are counted in ``trace``."""
    backward = [o.index for o in trace.ops if o.phase == Phase.BACKWARD]
    end = len(trace.ops) - 1
    return ReferenceSteps(end_of_loss=backward[0] - 1 if backward else end,
                          end_of_backward=backward[-1] if backward else None, end=end)


def parameter_step(lifetimes: Iterable[Lifetime], trace: Trace) -> int:
    """Where parameters and buffers are counted: before the first op (-1), where the step's
    model already exists, else after the last op (a program that builds its model as it
    runs, graphmem run)."""
    if any(life.start <= -1 <= life.end and life.category == Category.PARAMETER for life in lifetimes):
        return -1
    return len(trace.ops) - 1


def live_by_category(lifetimes: Iterable[Lifetime], step: int, scratch_bytes: int = 0
                     ) -> dict[Category, int]:
    """Bytes live after op ``step``, per category (every category present, zero or not)."""
    totals = dict.fromkeys(Category, 0)
    for life in lifetimes:
        if life.start <= step <= life.end:
            totals[life.category] += life.nbytes
    totals[Category.TEMPORARY] += scratch_bytes
    return totals


def build_mode_report(trace: Trace, lifetimes: tuple[Lifetime, ...],
                      modeled_ops: Collection[str] = ()) -> ModeReport:
    """Peak, breakdown at the peak, per-phase peaks and totals for one traced mode.

    Args:
        trace: stage 2's output.
        lifetimes: stage 3a's output for that trace.
        modeled_ops: names of ops with a scratch rule on the target device.
    """
    if not trace.ops:
        raise AssertionError("build_mode_report: the trace holds no op")
    timeline = compute_timeline(lifetimes, trace)
    step = max(range(len(timeline)), key=timeline.__getitem__)
    op = trace.ops[step]
    steps = reference_steps(trace)
    persistent = live_by_category(lifetimes, parameter_step(lifetimes, trace))
    return ModeReport(
        mode=trace.mode, optimizer=trace.optimizer, peak_bytes=timeline[step],
        peak=PeakInfo(step=step, op=op.op, module=charged_module(op), phase=str(op.phase), iteration=op.iteration),
        breakdown=live_by_category(lifetimes, step, op.scratch_bytes),
        phases=_phase_peaks(trace, timeline), timeline=timeline,
        params_bytes=persistent[Category.PARAMETER], buffers_bytes=persistent[Category.BUFFER],
        inputs_bytes=sum(life.nbytes for life in lifetimes if life.category == Category.INPUT),
        grads_bytes=(live_by_category(lifetimes, steps.end_of_backward)[Category.GRADIENT]
                     if steps.end_of_backward is not None else 0),
        optimizer_state_bytes=live_by_category(lifetimes, steps.end)[Category.OPTIMIZER_STATE],
        activations_bytes=live_by_category(lifetimes, steps.end_of_loss)[Category.ACTIVATION],
        num_ops=len(trace.ops),
        unmodeled_ops=tuple(sorted({o.op for o in trace.ops} - set(modeled_ops))),
        trace=trace, lifetimes=lifetimes,
        iteration_peaks=_iteration_peaks(trace, timeline),
        flops=sum(o.flops for o in trace.ops),
        recompute_flops=sum(o.flops for o in trace.ops if o.recompute),
        assumptions=trace.assumptions)


def _iteration_peaks(trace: Trace, timeline: tuple[int, ...]) -> tuple[int, ...]:
    peaks: dict[int, int] = {}
    for op, live in zip(trace.ops, timeline, strict=False):
        peaks[op.iteration] = max(peaks.get(op.iteration, 0), live)
    return tuple(peaks[i] for i in sorted(peaks))


def _phase_peaks(trace: Trace, timeline: tuple[int, ...]) -> tuple[PhasePeak, ...]:
    best: dict[Phase, tuple[int, int]] = {}
    for op, live in zip(trace.ops, timeline, strict=False):
        if op.phase not in best or live > best[op.phase][0]:
            best[op.phase] = (live, op.index)
    return tuple(PhasePeak(phase=str(p), peak_bytes=best[p][0], step=best[p][1])
                 for p in Phase if p in best)


def memory_events(lifetimes: Iterable[Lifetime], num_ops: int) -> tuple[MemoryEvent, ...]:
    """The alloc/free sequence of a run: storages that exist before the first op first, then
    per op its allocations, then the releases that follow it.  Storages still live after
    the last op are never freed.  Scratch bytes are not included (they have no storage).
    """
    allocs: dict[int, list[Lifetime]] = {}
    frees: dict[int, list[Lifetime]] = {}
    for life in lifetimes:
        allocs.setdefault(life.start, []).append(life)
        if life.end < num_ops - 1:
            frees.setdefault(life.end, []).append(life)
    events = [MemoryEvent("alloc", life.sid, life.nbytes, -1) for life in allocs.get(-1, [])]
    # per op: its allocations (in creation order), then what is released right after it
    for step in range(num_ops):
        events += [MemoryEvent("alloc", life.sid, life.nbytes, step) for life in allocs.get(step, [])]
        events += [MemoryEvent("free", life.sid, life.nbytes, step) for life in frees.get(step, [])]
    return tuple(events)
