"""Stage 4 for the pre-flight commands: ``check`` and ``max-batch`` / ``max-seq`` answers, and
``analyze --sweep``'s peak curve, as text or JSON.  ``CHECK_RENDERERS``, ``SEARCH_RENDERERS``
and ``SWEEP_RENDERERS`` map each ``--format`` name to its function.  JSON sizes are bytes;
text sizes follow ``--units``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from graphmem.report.header import render_header
from graphmem.units import format_bytes

if TYPE_CHECKING:
    from graphmem.memory.results import MemoryReport
    from graphmem.preflight.budget import Budget
    from graphmem.preflight.check import CheckResult, SearchResult, Sweep, SweepPoint

__all__ = [
    "CHECK_RENDERERS",
    "SEARCH_RENDERERS",
    "SWEEP_RENDERERS",
    "Context",
    "check_to_dict",
    "header",
    "render_check_table",
    "render_search_table",
    "search_to_dict",
    "sweep_to_dict",
]

_METRIC_WORDS = {"peak_bytes": "tensor bytes at the peak",
                 "allocated_peak_bytes": "allocated peak (torch.cuda.max_memory_allocated)"}


@dataclass(frozen=True, slots=True)
class Context:
    """What the command analysed, for the header: TARGET as typed, inputs, device, mode."""

    target: str
    inputs: tuple[str, ...]
    device: str
    mode: str
    gpu: str | None = None


def _budget_dict(budget: Budget) -> dict[str, Any]:
    return {"budget_bytes": budget.total_bytes, "budget": budget.source, "margin": float(budget.margin),
            "cap_bytes": budget.cap_bytes}


def header(command: str, context: Context, report: MemoryReport | None = None,
           fmt: Callable[[int], str] = format_bytes) -> str:
    """The pre-flight commands' header: the model, its parameters (with ``report``), the inputs,
    what is analysed, the optimizer and the device."""
    return render_header(f"graphmem {command}", context.target, context.inputs, context.device,
                         gpu=context.gpu, mode=context.mode, report=report,
                         parallel=report.parallel if report else None, fmt=fmt)


def check_to_dict(result: CheckResult, context: Context) -> dict[str, Any]:
    """The JSON object of ``graphmem check`` (bytes)."""
    return {"target": context.target, "inputs": list(context.inputs), "device": context.device,
            "gpu": context.gpu, "mode": context.mode, "fits": result.fits, "metric": result.metric,
            "peak_bytes": result.peak_bytes, "required_bytes": result.required_bytes,
            **_budget_dict(result.budget), "headroom_bytes": max(result.headroom_bytes, 0),
            "shortfall_bytes": max(-result.headroom_bytes, 0),
            "reserved_peak_bytes": result.reserved_peak_bytes,
            **({"nccl_buffer_bytes": nccl} if (nccl := _nccl_buffer_bytes(result.report)) is not None else {})}


def _nccl_buffer_bytes(report: MemoryReport | None) -> int | None:
    """NCCL's own buffers on one GPU, on the CUDA target with --parallel (None otherwise)."""
    if report is None or report.parallel is None:
        return None
    stats = [m.allocator for m in (report.inference, report.train) if m is not None and m.allocator is not None]
    return max((s.nccl_buffer_bytes for s in stats), default=None)


def render_check_table(result: CheckResult, context: Context, units: str = "auto") -> str:
    """The verdict, the peak, the peak with its margin and the budget; headroom or shortfall."""
    fmt: Callable[[int], str] = lambda n: format_bytes(n, units)
    rows = [["predicted peak", fmt(result.peak_bytes), _METRIC_WORDS[result.metric]],
            [f"with {float(result.budget.margin):.0%} margin", fmt(result.required_bytes), ""],
            ["budget", fmt(result.budget.total_bytes), result.budget.source]]
    if result.reserved_peak_bytes is not None:
        rows.append(["reserved peak", fmt(result.reserved_peak_bytes),
                     "torch.cuda.max_memory_reserved (nvidia-smi adds the CUDA context)"])
    nccl = _nccl_buffer_bytes(result.report)
    if nccl is not None:
        rows.append(["NCCL buffers", fmt(nccl), "NCCL's own, outside PyTorch's allocator: not in the peak, "
                                                "but nvidia-smi counts them (--nccl-buffer-mb)"])
    share = abs(result.headroom_bytes) / result.budget.total_bytes
    verdict = (f"FITS: {fmt(result.headroom_bytes)} headroom ({share:.1%} of the budget)" if result.fits else
               f"DOES NOT FIT: short by {fmt(-result.headroom_bytes)} ({share:.1%} of the budget); "
               "graphmem plan lists what to change")
    return "\n\n".join([header("check", context, result.report, fmt), tabulate(rows, tablefmt="plain"), verdict]) + "\n"


def render_check_json(result: CheckResult, context: Context, units: str = "auto") -> str:
    return json.dumps(check_to_dict(result, context), indent=2) + "\n"


def _unit_word(key: str) -> str:
    return "token" if key == "max_seq" else "sample"


def search_to_dict(result: SearchResult, context: Context, key: str = "max_batch") -> dict[str, Any]:
    """The JSON object of ``graphmem max-batch`` (key ``max_batch``) or ``max-seq`` (``max_seq``)."""
    return {key: result.max_value, "peak_bytes_at_max": result.peak_bytes_at_max,
            "peak_bytes_at_next": result.peak_bytes_at_next,
            f"bytes_per_{_unit_word(key)}": result.bytes_per_unit, "fixed_bytes": result.fixed_bytes,
            "affine": result.affine, "symbol": result.symbol, "limited_by": result.limited_by,
            "target": context.target,
            "inputs": list(context.inputs), "device": context.device, "gpu": context.gpu,
            "mode": context.mode,
            **_budget_dict(result.budget), "analyses": len(result.evaluated), "recorded": list(result.recorded),
            "evaluated": [{"value": v, "peak_bytes": b} for v, b in result.evaluated]}


def render_search_table(result: SearchResult, context: Context, units: str = "auto",
                        key: str = "max_batch") -> str:
    """The answer, the peaks at it and one past it, the fitted line and every analysis."""
    fmt: Callable[[int], str] = lambda n: format_bytes(n, units)
    s, n = result.symbol, result.max_value
    at_max = fmt(result.peak_bytes_at_max) if result.peak_bytes_at_max is not None else "-"
    beyond = (["does not fit", fmt(result.peak_bytes_at_next)] if result.peak_bytes_at_next is not None
              else ["the model refuses it", result.limited_by or ""])
    rows = [[f"{s} = {n}", at_max, "fits" if n else "(nothing fits)"],
            [f"{s} = {n + 1}", beyond[1], beyond[0]],
            ["budget", fmt(result.budget.total_bytes),
             (f"{result.budget.source}; margin {float(result.budget.margin):.0%}, so peaks up to "
              f"{fmt(result.budget.cap_bytes)} fit")]]
    if result.bytes_per_unit is not None and result.fixed_bytes is not None:
        shape = "affine" if result.affine else "not affine: the search bracketed it"
        rows.append([f"bytes per {_unit_word(key)}", fmt(result.bytes_per_unit),
                     f"fitted near the answer, + {fmt(result.fixed_bytes)} fixed ({shape})"])
    done = ", ".join(f"{v}" for v, _ in result.evaluated)
    recorded = ", ".join(str(v) for v in sorted(result.recorded))
    records = f"{len(result.recorded)} recording{'s' if len(result.recorded) != 1 else ''} of the step"
    command = key.replace("_", "-")
    answer = f"{command}: {n}" if n else f"{command}: 0 (even {s} = 1 does not fit)"
    if result.limited_by:
        answer += f" (the model's limit, not the budget's: {result.limited_by})"
    return "\n\n".join([header(command, context, fmt=fmt), answer, tabulate(rows, tablefmt="plain"),
                        f"{len(result.evaluated)} analyses, at {s} = {done}\n"
                        f"{records} (at {s} = {recorded}); the other sizes were evaluated from them"]) + "\n"


def render_search_json(result: SearchResult, context: Context, units: str = "auto",
                       key: str = "max_batch") -> str:
    return json.dumps(search_to_dict(result, context, key), indent=2) + "\n"


_BAR = 30  # characters of the longest bar in the sweep chart


def sweep_to_dict(result: Sweep, context: Context) -> dict[str, Any]:
    """The JSON object of ``graphmem analyze --sweep`` (bytes)."""
    return {"target": context.target, "inputs": list(context.inputs), "device": context.device,
            "gpu": context.gpu, "symbol": result.symbol,
            "points": [{"value": p.value, "inference_peak_bytes": p.inference_peak_bytes,
                        "train_peak_bytes": p.train_peak_bytes,
                        **({"fits": _fits(p, result.budget)} if result.budget else {})} for p in result.points],
            **(_budget_dict(result.budget) if result.budget else {}), "recorded": list(result.recorded)}


def _fits(point: SweepPoint, budget: Budget) -> bool:
    return all(budget.fits(b) for b in (point.inference_peak_bytes, point.train_peak_bytes) if b is not None)


def render_sweep_table(result: Sweep, context: Context, units: str = "auto") -> str:
    """Peak against the swept dimension: one row per value, a bar per row (the highest mode),
    and with a GPU the budget line (``|`` on the bars) and whether each value fits."""
    fmt: Callable[[int], str] = lambda n: format_bytes(n, units)
    highest = [max(b for b in (p.inference_peak_bytes, p.train_peak_bytes) if b is not None) for p in result.points]
    budget = result.budget.total_bytes if result.budget else None
    shown = budget is not None and budget <= 2 * max(highest)  # else the bars would be too short to read
    top = max([*highest, budget if shown and budget else 0])
    line = round(_BAR * budget / top) if shown and budget else None
    modes = [(name, key) for name, key in (("inference", "inference_peak_bytes"), ("train", "train_peak_bytes"))
             if any(getattr(p, key) is not None for p in result.points)]
    rows = []
    for point, peak in zip(result.points, highest, strict=True):
        bar = "█" * max(round(_BAR * peak / top), 1)
        if line is not None:
            bar = (bar + " " * _BAR)[:max(len(bar), line)]
            bar = bar[:line] + "|" + bar[line + 1:] if line < len(bar) else bar + "|"
        rows.append([f"{result.symbol} = {point.value}", *(fmt(getattr(point, key)) for _, key in modes),
                     *(["fits" if _fits(point, result.budget) else "does not fit"] if result.budget else []), bar])
    headers = [result.symbol, *(name for name, _ in modes), *(["budget"] if result.budget else []), "peak"]
    recorded = ", ".join(str(v) for v in sorted(result.recorded))
    notes = [f"{len(result.recorded)} recording{'s' if len(result.recorded) != 1 else ''} of the step (at "
             f"{result.symbol} = {recorded}); the other values were evaluated from them"]
    if result.budget:
        where = "| on the bars" if line is not None else "beyond the longest bar"
        notes.insert(0, f"budget: {fmt(result.budget.total_bytes)} ({result.budget.source}), {where}")
    return "\n\n".join([header("analyze", context, result.report, fmt), tabulate(rows, headers=headers),
                        "\n".join(notes)]) + "\n"


def render_sweep_json(result: Sweep, context: Context, units: str = "auto") -> str:
    return json.dumps(sweep_to_dict(result, context), indent=2) + "\n"


SWEEP_RENDERERS: dict[str, Callable[..., str]] = {"table": render_sweep_table, "json": render_sweep_json}
CHECK_RENDERERS: dict[str, Callable[..., str]] = {"table": render_check_table, "json": render_check_json}
SEARCH_RENDERERS: dict[str, Callable[..., str]] = {"table": render_search_table, "json": render_search_json}
