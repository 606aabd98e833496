"""Stage 4 for the pre-flight commands: ``check`` and ``max-batch`` / ``max-seq`` answers, and
``analyze --sweep``'s peak curve, as text or JSON.  ``CHECK_RENDERERS``, ``SEARCH_RENDERERS``
and ``SWEEP_RENDERERS`` map each ``--format`` name to its function.  JSON sizes are bytes;
text sizes follow ``--units``.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tabulate import tabulate

from graphmem.job.option import spelling
from graphmem.report.header import Settings, render_header, settings_to_dict
from graphmem.report.table import unseen_line
from graphmem.units import UNITS, format_bytes

if TYPE_CHECKING:
    from graphmem.memory.results import MemoryReport
    from graphmem.preflight.budget import Budget
    from graphmem.preflight.footprint import Footprint
    from graphmem.preflight.search import SearchResult, Sweep, SweepPoint
    from graphmem.preflight.verdict import CheckResult

__all__ = [
    "CHECK_RENDERERS",
    "SEARCH_RENDERERS",
    "SWEEP_RENDERERS",
    "Context",
    "check_to_dict",
    "context_dict",
    "header",
    "render_check_table",
    "render_verdict",
    "render_search_table",
    "search_to_dict",
    "sweep_to_dict",
    "told_apart",
]

@dataclass(frozen=True, slots=True)
class Context:
    """What the command analysed, for the header: TARGET as typed, inputs, device, mode, the
    GPU and the job's settings that change its numbers."""

    target: str
    inputs: tuple[str, ...]
    device: str
    mode: str
    gpu: str | None = None
    setup: Settings | None = None


def _budget_dict(budget: Budget) -> dict[str, Any]:
    return {"budget_bytes": budget.total_bytes, "budget": budget.source, "margin": float(budget.margin),
            "cap_bytes": budget.cap_bytes}


def context_dict(context: Context, report: MemoryReport | None = None) -> dict[str, Any]:
    """The JSON fields that say what was analysed: target, inputs, device, GPU, mode and every
    setting that changes the numbers."""
    return {"target": context.target, "inputs": list(context.inputs), "device": context.device,
            "gpu": context.gpu, "mode": context.mode,
            **(settings_to_dict(context.setup, report) if context.setup is not None else {})}


def header(command: str, context: Context, report: MemoryReport | None = None,
           fmt: Callable[[int], str] = format_bytes) -> str:
    """The pre-flight commands' header: the model, its parameters (with ``report``), the inputs,
    what is analysed, the step's settings and the device."""
    return render_header(f"graphmem {command}", context.target, context.inputs, context.device,
                         gpu=context.gpu, mode=context.mode, report=report,
                         parallel=report.parallel if report else None, fmt=fmt, setup=context.setup)


def check_to_dict(result: CheckResult, context: Context) -> dict[str, Any]:
    """The JSON object of ``graphmem check`` (bytes)."""
    f = result.footprint
    data = {**context_dict(context, result.report), "fits": result.fits, "metric": result.metric,
            "compared_bytes": result.peak_bytes, "peak_bytes": f.peak_bytes, "required_bytes": result.required_bytes,
            **_budget_dict(result.budget), "headroom_bytes": max(result.headroom_bytes, 0),
            "shortfall_bytes": max(-result.headroom_bytes, 0), "reserved_peak_bytes": f.reserved_peak_bytes}
    if not f.cuda:
        return data
    expandable = result.expandable
    data.update(allocated_peak_bytes=f.peak_bytes, active_peak_bytes=f.peak_bytes,
                nvidia_smi_estimate_bytes=f.nvidia_smi_bytes, cuda_context_bytes=f.cuda_context_bytes,
                **({"nccl_buffer_bytes": f.nccl_buffer_bytes} if result.report.parallel is not None else {}),
                outside_allocator_bytes=f.outside_bytes, allocated_fits=result.allocated_fits,
                allocated_headroom_bytes=result.budget.total_bytes - result.allocated_required_bytes,
                rank=f.rank,
                expandable_segments=None if expandable is None else {
                    "alloc_conf": expandable.alloc_conf, "fits": expandable.fits,
                    "allocated_peak_bytes": expandable.footprint.peak_bytes,
                    "reserved_peak_bytes": expandable.footprint.reserved_peak_bytes,
                    "compared_bytes": expandable.footprint.needed_bytes, "required_bytes": expandable.required_bytes,
                    "headroom_bytes": expandable.headroom_bytes(result.budget)})
    return data


def _outside_words(f: Footprint) -> str:
    return "CUDA context" + (" + NCCL buffers" if f.nccl_buffer_bytes else "")


def _share(nbytes: int, budget: Budget) -> str:
    return f"{abs(nbytes) / budget.total_bytes:.1%} of the budget"


def _cuda_rows(result: CheckResult, context: Context, fmt: Callable[[int], str]) -> str:
    """The allocated and reserved peaks, what lives outside the allocator, the budget, and the
    headroom of each peak with it."""
    f, budget = result.footprint, result.budget
    rank = f" (rank {f.rank})" if f.rank is not None and f.rank != _shown_rank(result.report) else ""
    rows = [[f"allocated peak{rank}", fmt(f.peak_bytes), "torch.cuda.max_memory_allocated(): the tensors"],
            [f"peak active{rank}", fmt(f.peak_bytes),
             "memory_stats()['active_bytes.all.peak']: allocated + blocks waiting on another stream (none modelled)"],
            [f"reserved peak{rank}", fmt(f.reserved_peak_bytes or 0),
             "torch.cuda.max_memory_reserved(): the segments the caching allocator obtains from the GPU"],
            ["CUDA context", fmt(f.cuda_context_bytes), "outside the allocator (an estimate for the GPU)"]]
    if result.report.parallel is not None:
        rows.append(["NCCL buffers", fmt(f.nccl_buffer_bytes), "NCCL's own, outside the allocator "
                                                               f"({spelling('nccl_buffer_mb')})"])
    rows.append(["budget", fmt(budget.total_bytes), budget.source])
    outside = _outside_words(f)
    margin = float(budget.margin)
    heads = ["", "on the GPU", *([f"with {margin:.0%} margin"] if margin else []), "headroom"]
    table = [[f"allocated + {outside}", fmt(f.allocated_needed_bytes),
              *([fmt(result.allocated_required_bytes)] if margin else []),
              fmt(budget.total_bytes - result.allocated_required_bytes)],
             [f"reserved + {outside}", fmt(result.peak_bytes), *([fmt(result.required_bytes)] if margin else []),
              fmt(result.headroom_bytes)]]
    if result.metric == "nvidia_smi_estimate_bytes":
        table.append([f"nvidia-smi estimate (reserved + {outside})", fmt(result.peak_bytes),
                      *([fmt(result.required_bytes)] if margin else []), fmt(result.headroom_bytes)])
    return (str(tabulate(rows, tablefmt="plain")) + "\n\n" + str(tabulate(table, headers=heads, tablefmt="plain"))
            + "\n" + COMPARED[result.metric])


# under check's table on a GPU: what the verdict compares (check --metric)
COMPARED = {
    "reserved_peak_bytes": ("(the verdict compares the reserved peak: the GPU must hold every segment the "
                            "allocator keeps)"),
    "allocated_peak_bytes": "(the verdict compares the allocated peak, --metric allocated: the tensors, as if the "
                            "allocator cached nothing; the reserved peak is what a run holds)",
    "nvidia_smi_estimate_bytes": "(the verdict compares the nvidia-smi estimate, --metric nvidia-smi: reserved + what "
                                 "lives outside the allocator, the same bytes as the reserved row)",
}


def _shown_rank(report: MemoryReport) -> int | None:
    modes = [m for m in (report.train, report.inference) if m is not None and m.ranks]
    return modes[0].ranks[0].rank if modes else None


_PLAN = "graphmem plan lists what to change"


def _verdict(result: CheckResult, fmt: Callable[[int], str], hint: str = _PLAN) -> str:
    """FITS / DOES NOT FIT, and on the CUDA target what closes a gap the allocator makes;
    ``hint``: where to look next when it does not fit."""
    budget = result.budget
    if result.fits:
        return f"FITS: {fmt(result.headroom_bytes)} headroom ({_share(result.headroom_bytes, budget)})"
    short = f"short by {fmt(-result.headroom_bytes)} ({_share(result.headroom_bytes, budget)})"
    if not result.footprint.cuda or not result.allocated_fits:
        return f"DOES NOT FIT: {short}; {hint}"
    f = result.footprint
    lines = [f"DOES NOT FIT: the reserved peak + {_outside_words(f)} is {short}, though the allocated peak fits "
             f"({fmt(budget.total_bytes - result.allocated_required_bytes)} headroom): the caching allocator holds "
             f"{fmt((f.reserved_peak_bytes or 0) - f.peak_bytes)} more than the tensors, in segments it cannot reuse."]
    e = result.expandable
    if e is None:
        lines.append(hint[0].upper() + hint[1:])
        return "\n".join(textwrap.fill(line, width=100) for line in lines)
    room = e.headroom_bytes(budget)
    outcome = (f"fits with {fmt(room)} headroom ({_share(room, budget)})" if e.fits
               else f"still short by {fmt(-room)}; {hint}")
    lines.append(f"Remedy: PYTORCH_CUDA_ALLOC_CONF={e.alloc_conf} ({spelling('alloc_conf')} {e.alloc_conf}), "
                 "analysed: reserved "
                 f"peak {fmt(e.footprint.reserved_peak_bytes or 0)} ({fmt(e.footprint.needed_bytes)} with the "
                 f"{_outside_words(e.footprint)}): {outcome}")
    return "\n".join(textwrap.fill(line, width=100) for line in lines)


def render_check_table(result: CheckResult, context: Context, units: str = "auto") -> str:
    """The verdict; the peak, the peak with its margin and the budget (CUDA: the allocated and
    reserved peaks, the memory outside the allocator and the headroom of each); headroom or
    shortfall, and on the CUDA target the remedy for a gap the allocator makes."""
    fmt: Callable[[int], str] = lambda n: format_bytes(n, units)
    return "\n\n".join([header("check", context, result.report, fmt), render_verdict(result, context, units)])


def render_verdict(result: CheckResult, context: Context, units: str = "auto", hint: str = _PLAN) -> str:
    """The compared bytes against the budget and the verdict (check's table below its header);
    ``hint``: where to look next when it does not fit."""
    fmt: Callable[[int], str] = lambda n: format_bytes(n, units)
    if result.footprint.cuda:
        body = _cuda_rows(result, context, fmt)
    else:
        body = tabulate([["predicted peak", fmt(result.peak_bytes), "tensor bytes at the peak"],
                         [f"with {float(result.budget.margin):.0%} margin", fmt(result.required_bytes), ""],
                         ["budget", fmt(result.budget.total_bytes), result.budget.source]], tablefmt="plain")
    modes = [m for m in (result.report.inference, result.report.train) if m is not None]
    return "\n\n".join([body + unseen_line(modes), _verdict(result, fmt, hint)]) + "\n"


def render_check_json(result: CheckResult, context: Context, units: str = "auto") -> str:
    return json.dumps(check_to_dict(result, context), indent=2) + "\n"


def _unit_word(key: str) -> str:
    return "token" if key == "max_seq" else "sample"


def search_to_dict(result: SearchResult, context: Context, key: str = "max_batch") -> dict[str, Any]:
    """The JSON object of ``graphmem max-batch`` (key ``max_batch``) or ``max-seq`` (``max_seq``)."""
    return {key: result.max_value, "metric": _metric(context), "peak_bytes_at_max": result.peak_bytes_at_max,
            "peak_bytes_at_next": result.peak_bytes_at_next,
            f"bytes_per_{_unit_word(key)}": result.bytes_per_unit, "fixed_bytes": result.fixed_bytes,
            "affine": result.affine, "symbol": result.symbol, "limited_by": result.limited_by,
            **context_dict(context, result.report_at_max),
            **_budget_dict(result.budget), "analyses": len(result.evaluated), "recorded": list(result.recorded),
            "evaluated": [{"value": v, "peak_bytes": b} for v, b in result.evaluated]}


def _metric(context: Context) -> str:
    """What the pre-flight peaks are: CPU tensor bytes; CUDA reserved + outside the allocator."""
    return "reserved_peak_bytes" if context.device == "cuda" else "peak_bytes"


# under the pre-flight tables on the CUDA target: what their peaks are
COMPARED_NOTE = ("peaks on a GPU: the caching allocator's reserved peak (torch.cuda.max_memory_reserved) + the "
                 "CUDA context (+ NCCL buffers), what the GPU must hold")


def told_apart(sizes: list[int], fmt: Callable[[int], str]) -> dict[int, str]:
    """Each of ``sizes`` as text; those that would read the same as a different one ("22.06
    GiB" twice: the answer and one past it) with more digits, at last in bytes."""
    texts = {n: fmt(n) for n in sizes}
    alike = sorted({n for n in texts if any(m != n and texts[m] == texts[n] for m in texts)})
    if not alike:
        return texts
    unit = texts[alike[0]].rsplit(" ", 1)[-1]
    same_unit = all(texts[n].rsplit(" ", 1)[-1] == unit for n in alike) and unit in UNITS and unit != "B"
    for digits in range(3, 7) if same_unit else ():
        more = {n: f"{n / UNITS[unit]:,.{digits}f} {unit}" for n in alike}
        if len(set(more.values())) == len(alike):
            return {**texts, **more}
    return {**texts, **{n: f"{n:,} B" for n in alike}}


def render_search_table(result: SearchResult, context: Context, units: str = "auto",
                        key: str = "max_batch") -> str:
    """The answer, the peaks at it and one past it, the fitted line and every analysis."""
    fmt: Callable[[int], str] = lambda n: format_bytes(n, units)
    s, n = result.symbol, result.max_value
    # the answer, one past it and the budget between them: never two of them written alike
    budget = result.budget
    near = told_apart([v for v in (result.peak_bytes_at_max, result.peak_bytes_at_next, budget.cap_bytes,
                                   budget.total_bytes) if v is not None], fmt)
    at_max = near[result.peak_bytes_at_max] if result.peak_bytes_at_max is not None else "-"
    beyond = (["does not fit", near[result.peak_bytes_at_next]] if result.peak_bytes_at_next is not None
              else ["the model refuses it", result.limited_by or ""])
    rows = [[f"{s} = {n}", at_max, "fits" if n else "(nothing fits)"],
            [f"{s} = {n + 1}", beyond[1], beyond[0]],
            ["budget", near[budget.total_bytes],
             (f"{budget.source}; margin {float(budget.margin):.0%}, so peaks up to {near[budget.cap_bytes]} fit")]]
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
    analyses = f"{len(result.evaluated)} analys{'is' if len(result.evaluated) == 1 else 'es'}"
    notes = (f"{analyses}, at {s} = {done}\n"
             f"{records} (at {s} = {recorded}); the other sizes were evaluated from them")
    if context.device == "cuda":
        notes = COMPARED_NOTE + "\n" + notes
    return "\n\n".join([header(command, context, result.report_at_max, fmt=fmt), answer,
                        tabulate(rows, tablefmt="plain"), notes]) + "\n"


def render_search_json(result: SearchResult, context: Context, units: str = "auto",
                       key: str = "max_batch") -> str:
    return json.dumps(search_to_dict(result, context, key), indent=2) + "\n"


_BAR = 30  # characters of the longest bar in the sweep chart


def sweep_to_dict(result: Sweep, context: Context) -> dict[str, Any]:
    """The JSON object of ``graphmem analyze --sweep`` (bytes)."""
    return {"target": context.target, "inputs": list(context.inputs), "device": context.device,
            "gpu": context.gpu, "symbol": result.symbol,
            "points": [{"value": p.value, "inference_peak_bytes": p.inference_peak_bytes,
                        "train_peak_bytes": p.train_peak_bytes, "needed_bytes": p.needed_bytes,
                        **({"fits": _fits(p, result.budget)} if result.budget else {})} for p in result.points],
            **(_budget_dict(result.budget) if result.budget else {}), "recorded": list(result.recorded)}


def _fits(point: SweepPoint, budget: Budget) -> bool:
    """Whether the value fits as ``check`` would say (on CUDA: the reserved peak + the CUDA context)."""
    return budget.fits(point.needed_bytes)


def render_sweep_table(result: Sweep, context: Context, units: str = "auto") -> str:
    """Peak against the swept dimension: one row per value, a bar per row (the highest mode;
    on a GPU what it must hold), and with a GPU the budget line (``|`` on the bars) and whether
    each value fits."""
    fmt: Callable[[int], str] = lambda n: format_bytes(n, units)
    cuda = context.device == "cuda"
    highest = [p.needed_bytes if cuda else max(b for b in (p.inference_peak_bytes, p.train_peak_bytes)
                                               if b is not None) for p in result.points]
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
                     *([fmt(point.needed_bytes)] if cuda else []),
                     *(["fits" if _fits(point, result.budget) else "does not fit"] if result.budget else []), bar])
    headers = [result.symbol, *(name for name, _ in modes), *(["on the GPU"] if cuda else []),
               *(["budget"] if result.budget else []), "" if cuda else "peak"]
    recorded = ", ".join(str(v) for v in sorted(result.recorded))
    notes = [f"{len(result.recorded)} recording{'s' if len(result.recorded) != 1 else ''} of the step (at "
             f"{result.symbol} = {recorded}); the other values were evaluated from them"]
    if cuda:
        named = ", ".join(name for name, _ in modes)
        notes.insert(0, f"{named}: the allocated peak (torch.cuda.max_memory_allocated); on the GPU: the caching "
                        "allocator's reserved peak (torch.cuda.max_memory_reserved) + the "
                        "CUDA context, what the GPU must hold: what fits compares, as graphmem check does")
    if result.budget:
        where = "| on the bars" if line is not None else "beyond the longest bar"
        notes.insert(0, f"budget: {fmt(result.budget.total_bytes)} ({result.budget.source}), {where}")
    return "\n\n".join([header("analyze", context, result.report, fmt), tabulate(rows, headers=headers),
                        "\n".join(textwrap.fill(n, width=100) for n in notes)]) + "\n"


def render_sweep_json(result: Sweep, context: Context, units: str = "auto") -> str:
    return json.dumps(sweep_to_dict(result, context), indent=2) + "\n"


SWEEP_RENDERERS: dict[str, Callable[..., str]] = {"table": render_sweep_table, "json": render_sweep_json}
CHECK_RENDERERS: dict[str, Callable[..., str]] = {"table": render_check_table, "json": render_check_json}
SEARCH_RENDERERS: dict[str, Callable[..., str]] = {"table": render_search_table, "json": render_search_json}
