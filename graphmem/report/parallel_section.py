"""--parallel: the per-rank table and JSON (every distinct rank, the highest first)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tabulate import tabulate

from graphmem.memory.results import Category, MemoryReport, ModeReport, RankReport

__all__ = ["parallel_json", "parallel_table", "rank_rows"]


def _ranks_text(ranks: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)


RANK_HEADERS = ("ranks", "peak", "phase", "parameters", "gradients", "optimizer state", "activations",
                "communication")


def rank_rows(mode: ModeReport, fmt: Callable[[int], str]) -> tuple[list[str], list[list[str]]]:
    """The per-GPU table's headers and rows: one row per group of ranks whose memory is the same
    (its peak, where, and what is live there), the highest first."""
    cuda = mode.ranks[0].report.allocator is not None
    head = ["ranks", "allocated peak" if cuda else "peak", *RANK_HEADERS[2:]]
    rows = []
    for r in mode.ranks:
        m, b = r.report, r.report.breakdown
        phase = f"{m.peak.phase} (iteration {m.peak.iteration + 1})"
        rows.append([_ranks_text(r.ranks), fmt(m.budget_peak_bytes), phase,
                     *(fmt(b[c]) for c in (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE,
                                           Category.ACTIVATION, Category.COMMUNICATION))])
    return head, rows


def parallel_table(report: MemoryReport, mode: ModeReport, fmt: Callable[[int], str]) -> str:
    """One row per distinct rank: its peak, where, and what is live there."""
    head, rows = rank_rows(mode, fmt)
    world = sum(len(r.ranks) for r in mode.ranks)
    title = (f"Per GPU, {mode.mode} with {report.parallel} ({world} ranks; one row per group of ranks whose "
             "memory is the same; the sizes are those live at each rank's peak)")
    return str(title + "\n" + tabulate(rows, headers=head, tablefmt="simple", disable_numparse=True))


def _rank_dict(r: RankReport) -> dict[str, Any]:
    m = r.report
    data: dict[str, Any] = {"rank": r.rank, "ranks": list(r.ranks), "peak_bytes": m.peak_bytes,
                            "step_peak_bytes": list(m.iteration_peaks),
                            "peak": {"op": m.peak.op, "module": m.peak.module, "phase": m.peak.phase,
                                     "iteration": m.peak.iteration + 1, "step": m.peak.step},
                            "breakdown": {str(k): v for k, v in m.breakdown.items()}}
    if m.allocator is not None:
        data.update(allocated_peak_bytes=m.allocator.allocated_peak_bytes,
                    reserved_peak_bytes=m.allocator.reserved_peak_bytes,
                    nccl_buffer_bytes=m.allocator.nccl_buffer_bytes)
    return data


def parallel_json(mode: ModeReport) -> dict[str, Any]:
    """``ranks``: one object per distinct rank, the highest first (the mode's own numbers are its)."""
    return {"ranks": [_rank_dict(r) for r in mode.ranks]} if mode.ranks else {}
