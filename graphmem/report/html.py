"""Stage 4: the one-page report (``--html``).  MemoryReport -> one self-contained HTML page.

Input: a MemoryReport (and the ``--units`` and ``--depth`` of the command).
Output: a str holding one page that needs nothing else to open: no script, no external
style sheet, font or picture.  It shows the facts of the text header (model, parameters,
inputs, loss, optimizer, device and GPU), whether the step fits its budget (the GPU's memory
when ``--gpu`` names one: what the device must hold, as ``graphmem check`` compares it, on
the CUDA target the caching allocator's reserved peak plus the CUDA context and NCCL's
buffers), the peaks and where they happen, the memory timeline of each analysed mode (inline
SVG drawn here: live bytes after every op as a polyline, phases shaded, the peak marked, the
budget as a line, and on the CUDA target what the GPU must hold as a dotted line), the
categories live at each peak, the per-module table (``graphmem.report.modules``) and, with
``--parallel``, the per-rank table.

Timelines of more than ``MAX_POINTS`` ops are drawn from the highest op of each run of ops
(``series.bucket_peaks``), so the page stays small for big models and the peak is never
lost.  Every piece of text goes through ``html.escape``.  Pure; no plotting library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction
from html import escape

from graphmem.cuda.gpus import nvidia_smi_estimate
from graphmem.memory.results import Category, MemoryReport, ModeReport
from graphmem.preflight.budget import Budget
from graphmem.report.formats import HTML_SUFFIXES
from graphmem.report.header import render_header
from graphmem.report.modules import ROOT, ModuleRow, module_rows
from graphmem.report.parallel_section import rank_rows
from graphmem.report.paths import check_html_path
from graphmem.report.series import bucket_peaks, phase_spans
from graphmem.report.timeline import COLOURS, PHASE_SHADES, STACK_ORDER
from graphmem.units import UNITS, format_bytes

__all__ = ["HTML_SUFFIXES", "MAX_POINTS", "check_html_path", "decimate", "render_html"]

MAX_POINTS = 2000
Format = Callable[[int], str]
# the timeline picture's phase colours, and the two phases of --generate
SHADES = {**PHASE_SHADES, "prefill": "#e3e6f5", "decode": "#fbf0d0"}

# the chart's drawing area inside its viewBox (SVG user units)
_WIDTH, _HEIGHT = 1000, 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 78, 16, 26, 34

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 1.5em auto;
       max-width: 1100px; padding: 0 1em; color: #222; }
h1 { font-size: 1.35em; } h2 { font-size: 1.1em; margin-top: 1.8em; }
table { border-collapse: collapse; margin: 0.4em 0; font-size: 0.9em; }
th, td { padding: 0.2em 0.7em; border-bottom: 1px solid #ddd; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
table.facts th { background: none; font-weight: 600; border: none; } table.facts td { border: none; }
tr.total td { font-weight: 600; border-top: 2px solid #999; }
.share { display: inline-block; height: 0.7em; background: #4c72b0; }
.legend span.swatch { display: inline-block; width: 0.9em; height: 0.9em; margin: 0 0.3em 0 1em;
                      vertical-align: -0.1em; border: 1px solid #bbb; }
svg { width: 100%; height: auto; display: block; } svg text { font-size: 12px; fill: #333; }
p.note { color: #555; font-size: 0.9em; }
"""


def decimate(values: Sequence[int], max_points: int = MAX_POINTS) -> tuple[int, ...]:
    """Indices of ``values`` to draw: all of them when there are at most ``max_points``, else
    the first, the last and the highest of each of ``max_points - 2`` equal runs between,
    so the largest value (the peak) is always among them.  Sorted, at most ``max_points``."""
    if max_points < 3:
        raise AssertionError(f"decimate: max_points must be at least 3, got {max_points}")
    n = len(values)
    if n <= max_points:
        return tuple(range(n))
    return tuple(sorted({0, n - 1, *bucket_peaks(values, max_points - 2)}))


def render_html(report: MemoryReport, units: str = "auto", *, depth: int = 2, budget: Budget | None = None) -> str:
    """The page (see the module docstring).

    Args:
        report: the analysis.
        units: units of sizes (``auto``, ``B``, ``KiB``, ...).
        depth: levels of the module tree in the per-module table.
        budget: the memory the step may use; None: the GPU's memory when the report names a
            GPU, else no verdict and no budget line.

    Returns:
        The HTML document, UTF-8 text.
    """
    fmt: Format = lambda n: format_bytes(n, units)
    modes = _modes(report)
    if budget is None and report.gpu is not None:
        budget = Budget(report.gpu.total_memory_bytes, Fraction(0), f"{report.gpu.name} memory")
    title = f"graphmem: {report.target}"
    body = [f"<h1>{escape(title)}</h1>", _facts(report, fmt)]
    if budget is not None:
        body.append(_fit(report, modes, budget, fmt))
    body.append(_peaks(report, modes, fmt))
    for name, mode in modes:
        body.append(f"<h2>Memory timeline, {escape(name)}</h2>")
        body.append(_timeline_svg(mode, report, units, budget))
    body.append(_categories(modes, fmt))
    body.append(_modules(report, modes[-1], depth, fmt))
    body.extend(_ranks(report, name, mode, fmt) for name, mode in modes if mode.ranks)
    notes = sorted({note for _, mode in modes for note in mode.assumptions})
    body.extend(f'<p class="note">Assumed: {escape(note)}</p>' for note in notes)
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{escape(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


def _modes(report: MemoryReport) -> list[tuple[str, ModeReport]]:
    """(name, mode) for each analysed mode, the one the per-module table shows last."""
    if report.generate is not None:
        return [("prefill", report.generate.prefill), ("cache fill + decode step", report.generate.decode)]
    named = [("inference", report.inference),
             (f"train ({report.train.optimizer})" if report.train else "train", report.train)]
    return [(name, mode) for name, mode in named if mode is not None]


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int = 1, total: bool = False) -> str:
    """An HTML table; cells are text (escaped here) and columns from ``numeric_from`` on are
    right-aligned; ``total`` styles the last row as a total."""
    def cells(tag: str, values: Sequence[str]) -> str:
        return "".join(f'<{tag}{" class=num" if i >= numeric_from else ""}>{escape(v)}</{tag}>'
                       for i, v in enumerate(values))
    lines = ["<table>", f"<tr>{cells('th', head)}</tr>"]
    for i, row in enumerate(rows):
        last = total and i == len(rows) - 1
        lines.append(f'<tr{" class=total" if last else ""}>{cells("td", row)}</tr>')
    return "\n".join([*lines, "</table>"])


def _facts(report: MemoryReport, fmt: Format) -> str:
    """The rows of the text header (model, parameters, inputs, loss, optimizer, device...).

    They are read back from ``render_header``'s two-column block (one-word keys) so the page
    and the text report always state the same facts."""
    gen = report.generate
    mode = (f"generation of {gen.new_tokens} tokens after a {gen.prompt_tokens}-token prompt, batch {gen.batch}"
            if gen else None)
    text = render_header("", report.target, () if gen else report.inputs, report.device,
                         gpu=report.gpu.name if report.gpu else None, mode=mode, report=report,
                         parallel=report.parallel, fmt=fmt)
    rows = [line.split(maxsplit=1) for line in text.splitlines()[1:] if line.strip()]
    if report.gpu is not None:
        rows.append(["GPU memory", f"{report.gpu.product}: {fmt(report.gpu.total_memory_bytes)}"])
    body = "\n".join(f"<tr><th>{escape(row[0])}</th><td>{escape(row[-1])}</td></tr>" for row in rows)
    return f'<table class="facts">\n{body}\n</table>'


def _needed_bytes(report: MemoryReport, mode: ModeReport) -> tuple[int, int | None]:
    """What the device must hold for ``mode`` (the rank that needs the most): on the CUDA
    target the reserved peak plus the CUDA context and NCCL's buffers (the nvidia-smi
    estimate), else the tensor bytes at the peak; and on the CUDA target the allocated peak
    plus what lives outside the allocator (None elsewhere)."""
    gpu = report.gpu
    best: tuple[int, int | None] = (0, None)
    for m in [r.report for r in mode.ranks] or [mode]:
        stats = m.allocator
        if stats is None or gpu is None:
            best = max(best, (m.peak_bytes, None), key=lambda b: b[0])
            continue
        outside = gpu.cuda_context_bytes + stats.nccl_buffer_bytes
        needed = nvidia_smi_estimate(stats.reserved_peak_bytes, gpu, stats.nccl_buffer_bytes)
        best = max(best, (needed, stats.allocated_peak_bytes + outside), key=lambda b: b[0])
    return best


def _fit(report: MemoryReport, modes: list[tuple[str, ModeReport]], budget: Budget, fmt: Format) -> str:
    """Whether each mode fits ``budget``, as ``graphmem check`` answers it, and why."""
    share = lambda n: f"{abs(n) / budget.total_bytes:.1%} of the budget" if budget.total_bytes else ""
    cuda = any(_needed_bytes(report, m)[1] is not None for _, m in modes)
    outside = "CUDA context" + (" + NCCL buffers" if report.parallel else "")
    rows = [[f"on the GPU (reserved peak + {outside})" if cuda else "peak (live tensor bytes)"],
            [f"budget ({budget.source})"], ["verdict"]]
    notes = []
    for name, mode in modes:
        needed, allocated = _needed_bytes(report, mode)
        room = budget.total_bytes - budget.required_bytes(needed)
        fits = budget.fits(needed)
        rows[0].append(fmt(needed))
        rows[1].append(fmt(budget.total_bytes))
        rows[2].append(f"FITS: {fmt(room)} headroom ({share(room)})" if fits
                       else f"DOES NOT FIT: short by {fmt(-room)} ({share(room)})")
        if not fits and allocated is not None and budget.fits(allocated):
            notes.append(f"{name}: the allocated peak fits ({fmt(allocated)} with the {outside}), but the "
                         f"caching allocator holds {fmt(needed - allocated)} more in segments it cannot reuse; "
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True may close the gap (graphmem check "
                         "analyses it).")
    if budget.margin:
        rows[1][0] = f"budget ({budget.source}, keeping {float(budget.margin):.0%} free)"
    head = ["", *(name for name, _ in modes)]
    return ("<h2>Will it fit?</h2>\n" + _table(head, rows, numeric_from=1)
            + "".join(f'\n<p class="note">{escape(note)}</p>' for note in notes))


def _peaks(report: MemoryReport, modes: list[tuple[str, ModeReport]], fmt: Format) -> str:
    """The peak of each mode and where it happens; the allocator's peaks on the CUDA target."""
    head = ["", *(name for name, _ in modes)]
    rows = [["peak (live tensor bytes)", *(fmt(m.peak_bytes) for _, m in modes)]]
    if report.ratio is not None and report.generate is None:
        rows.append(["train / inference", *(f"{report.ratio:.2f}x" if m.mode == "train" else "" for _, m in modes)])
    rows += [["op", *(m.peak.op_name for _, m in modes)],
             ["module", *(_module_name(m.peak.module, report, m.peak.phase) for _, m in modes)],
             ["phase", *(f"{m.peak.phase} (iteration {m.peak.iteration + 1})" for _, m in modes)],
             ["op index", *(f"{m.peak.step} of {m.num_ops}" for _, m in modes)]]
    if any(m.allocator for _, m in modes):
        rows += [["allocated peak (max_memory_allocated)",
                  *(fmt(m.allocator.allocated_peak_bytes) if m.allocator else "" for _, m in modes)],
                 ["peak active (active_bytes.all.peak)",
                  *(fmt(m.allocator.active_peak_bytes) if m.allocator else "" for _, m in modes)],
                 ["reserved peak (max_memory_reserved)",
                  *(fmt(m.allocator.reserved_peak_bytes) if m.allocator else "" for _, m in modes)]]
    if report.gpu is not None and all(m.allocator for _, m in modes):
        gpu = report.gpu
        smi = [nvidia_smi_estimate(m.allocator.reserved_peak_bytes, gpu, m.allocator.nccl_buffer_bytes)
               for _, m in modes if m.allocator]
        rows += [["nvidia-smi estimate (+ CUDA context)", *(fmt(n) for n in smi)],
                 [f"share of {gpu.name} ({fmt(gpu.total_memory_bytes)})",
                  *(f"{n / gpu.total_memory_bytes:.1%}" for n in smi)]]
    return "<h2>Peaks</h2>\n" + _table(head, rows, numeric_from=1)


def _root(report: MemoryReport) -> str:
    return report.target.rpartition(":")[2] or report.target


def _module_name(module: str, report: MemoryReport, phase: str = "") -> str:
    """A module path for people: the ops outside every submodule are the root's (or the loss's)."""
    if module and module != ROOT:
        return module
    return "(loss)" if phase == "loss" else f"(root {_root(report)})"


def _axis_unit(top: int, units: str) -> str:
    if units != "auto":
        return units
    return next((u for u in reversed(UNITS) if top >= UNITS[u]), "B")


def _ticks(top: float, count: int = 5, whole: bool = False) -> list[float]:
    """Round tick values from 0 to at least ``top`` (about ``count`` of them): steps of 1, 2,
    2.5 or 5 times a power of ten; ``whole``: steps of at least 1 (op indices)."""
    if top <= 0:
        return [0.0]
    raw = top / count
    power = 10.0 ** int(f"{raw:e}".split("e")[1])
    power = max(power, 1.0) if whole else power
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw and (not whole or (m * power).is_integer()))
    return [i * step for i in range(int(top / step) + 2) if i * step <= top * 1.0001 or i == 0]


class _Scale:
    """Op index and bytes -> SVG coordinates of the drawing area."""

    def __init__(self, num_ops: int, top_bytes: int) -> None:
        self.num_ops = max(num_ops, 1)
        self.top = max(top_bytes, 1)

    def x(self, step: float) -> float:
        return round(_LEFT + (_WIDTH - _LEFT - _RIGHT) * (step + 0.5) / self.num_ops, 1)

    def y(self, nbytes: float) -> float:
        return round(_HEIGHT - _BOTTOM - (_HEIGHT - _TOP - _BOTTOM) * nbytes / self.top, 1)


def _timeline_svg(mode: ModeReport, report: MemoryReport, units: str, budget: Budget | None) -> str:
    """Live bytes after each op as a polyline over the shaded phases, the peak marked, the
    budget as a dashed line when it is within twice the peak (else named below), and on the
    CUDA target what the GPU must hold at its peak as a dotted line (what the budget is compared with)."""
    limit = budget.total_bytes if budget is not None else None
    needed, allocated = _needed_bytes(report, mode)
    on_gpu = needed if allocated is not None else None
    data_top = max(mode.peak_bytes, on_gpu or 0)
    shown = limit if limit is not None and limit <= 2 * data_top else None
    top = max(data_top, shown or 0)
    unit = _axis_unit(top, units)
    tick_values = [t * UNITS[unit] for t in _ticks(top * 1.15 / UNITS[unit])]
    scale = _Scale(len(mode.timeline), int(max(tick_values[-1], top * 1.15)))
    parts = [f'<svg viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" '
             f'aria-label="{escape(f"live bytes over {len(mode.timeline)} ops")}">']
    parts += _phase_shading(mode, scale)
    parts += _axes(mode, scale, tick_values, unit)
    points = " ".join(f"{scale.x(i)},{scale.y(mode.timeline[i])}" for i in decimate(mode.timeline))
    parts.append(f'<polyline class="live" points="{points}" fill="none" stroke="#1f4e8c" stroke-width="1.5"/>')
    if on_gpu is not None:
        parts.append(_level(scale, on_gpu, f"on the GPU at its peak (reserved + outside the allocator) "
                                           f"{format_bytes(on_gpu, units)}", "on-gpu", "#555", "2 3"))
    if shown is not None and budget is not None:
        parts.append(_level(scale, shown, f"budget {format_bytes(shown, units)} ({budget.source})", "budget",
                            "#b00020", "6 4"))
    parts.append(_peak_marker(mode, report, scale, units))
    parts.append("</svg>")
    present = dict.fromkeys(span.phase for span in phase_spans(mode.trace.ops))
    legend = _legend([(f"{phase} phase", SHADES.get(phase, "#eeeeee")) for phase in present])
    note = ""
    if limit is not None and shown is None and budget is not None:
        note = (f'<p class="note">The budget ({escape(budget.source)}) is {escape(format_bytes(limit, units))}, '
                f"{limit / max(data_top, 1):.1f} times this peak: its line is above the chart.</p>")
    return "\n".join(parts) + "\n" + legend + note


def _level(scale: _Scale, nbytes: int, label: str, css: str, colour: str, dashes: str) -> str:
    """A horizontal line across the chart at ``nbytes``, named at its right end."""
    y = scale.y(nbytes)
    return (f'<g class="{css}"><line x1="{_LEFT}" x2="{_WIDTH - _RIGHT}" y1="{y}" y2="{y}" stroke="{colour}" '
            f'stroke-dasharray="{dashes}"/><text x="{_WIDTH - _RIGHT - 4}" y="{y - 4}" '
            f'text-anchor="end">{escape(label)}</text></g>')


def _phase_shading(mode: ModeReport, scale: _Scale) -> list[str]:
    """One shaded band per run of a phase, named when wide; a dashed line where an iteration starts."""
    out = []
    n = len(mode.timeline)
    for span in phase_spans(mode.trace.ops):
        x0, x1 = scale.x(span.start - 0.5), scale.x(span.end + 0.5)
        name = f"{span.phase} {span.iteration + 1}"
        out.append(f'<rect x="{x0}" y="{_TOP}" width="{round(x1 - x0, 1)}" height="{_HEIGHT - _TOP - _BOTTOM}" '
                   f'fill="{SHADES.get(span.phase, "#eeeeee")}"><title>{escape(name)}: ops {span.start}'
                   f"-{span.end}</title></rect>")
        if span.end - span.start + 1 >= 0.06 * n:
            out.append(f'<text x="{round((x0 + x1) / 2, 1)}" y="{_TOP + 14}" text-anchor="middle">'
                       f"{escape(name)}</text>")
        if span.iteration > 0 and span.phase == "forward" and span.start > 0:
            out.append(f'<line x1="{x0}" x2="{x0}" y1="{_TOP}" y2="{_HEIGHT - _BOTTOM}" stroke="#777" '
                       'stroke-dasharray="4 3"/>')
    return out


def _axes(mode: ModeReport, scale: _Scale, tick_values: list[float], unit: str) -> list[str]:
    """The y grid with its labels in ``unit``, the x ticks on op indices, and the axis names."""
    out = []
    for value in tick_values:
        y = scale.y(value)
        label = f"{value / UNITS[unit]:g} {unit}"
        out.append(f'<line x1="{_LEFT}" x2="{_WIDTH - _RIGHT}" y1="{y}" y2="{y}" stroke="#ccc" stroke-width="0.6"/>'
                   f'<text x="{_LEFT - 6}" y="{y + 4}" text-anchor="end">{escape(label)}</text>')
    base = _HEIGHT - _BOTTOM
    for step in _ticks(max(len(mode.timeline) - 1, 1), 8, whole=True):
        x = scale.x(step)
        out.append(f'<line x1="{x}" x2="{x}" y1="{base}" y2="{base + 4}" stroke="#333"/>'
                   f'<text x="{x}" y="{base + 16}" text-anchor="middle">{int(step)}</text>')
    out.append(f'<line x1="{_LEFT}" x2="{_WIDTH - _RIGHT}" y1="{base}" y2="{base}" stroke="#333"/>'
               f'<text x="{_WIDTH - _RIGHT}" y="{_HEIGHT - 4}" text-anchor="end">op (execution order)</text>'
               f'<text x="12" y="{_TOP - 10}">live bytes</text>')
    return out


def _peak_marker(mode: ModeReport, report: MemoryReport, scale: _Scale, units: str) -> str:
    """A red marker on the peak and its bytes, op, module and phase beside it."""
    peak = mode.peak
    x, y = scale.x(peak.step), scale.y(mode.peak_bytes)
    right_half = peak.step > len(mode.timeline) / 2
    anchor, dx = ("end", -10) if right_half else ("start", 10)
    lines = [f"peak {format_bytes(mode.peak_bytes, units)} after op {peak.step}",
             f"{peak.op_name} in {_module_name(peak.module, report, peak.phase)}",
             f"{peak.phase} (iteration {peak.iteration + 1})"]
    text = "".join(f'<tspan x="{round(x + dx, 1)}" dy="{0 if i == 0 else 14}">{escape(line)}</tspan>'
                   for i, line in enumerate(lines))
    return (f'<g class="peak"><circle cx="{x}" cy="{y}" r="5" fill="#b00020"/>'
            f'<text x="{round(x + dx, 1)}" y="{y + 18}" text-anchor="{anchor}" '
            f'font-weight="600" stroke="#fff" stroke-width="4" paint-order="stroke">{text}</text></g>')


def _legend(items: Sequence[tuple[str, str]]) -> str:
    spans = "".join(f'<span class="swatch" style="background:{colour}"></span>{escape(label)}'
                    for label, colour in items)
    return f'<p class="legend">{spans}</p>'


def _category_name(category: Category) -> str:
    return str(category).replace("_", " ")  # "optimizer_state" -> "optimizer state"


def _categories(modes: list[tuple[str, ModeReport]], fmt: Format) -> str:
    """Live bytes by category at each peak: one stacked bar per mode and the table."""
    shown = [c for c in STACK_ORDER if any(m.breakdown[c] for _, m in modes)]
    widest = max((sum(m.breakdown.values()) for _, m in modes), default=0) or 1
    bars = []
    for row, (name, mode) in enumerate(modes):
        y, x = 8 + row * 34, 180.0
        bars.append(f'<text x="172" y="{y + 17}" text-anchor="end">{escape(name)}</text>')
        for c in shown:
            width = 800 * mode.breakdown[c] / widest
            tip = f"{_category_name(c)}: {fmt(mode.breakdown[c])}"
            if width > 0:
                bars.append(f'<rect x="{round(x, 1)}" y="{y}" width="{round(width, 1)}" height="24" '
                            f'fill="{COLOURS[c]}"><title>{escape(tip)}</title></rect>')
            x += width
    svg = f'<svg viewBox="0 0 1000 {16 + 34 * len(modes)}" role="img">{"".join(bars)}</svg>'
    rows = [[_category_name(c), *(fmt(m.breakdown[c]) for _, m in modes),
             *(f"{100 * m.breakdown[c] / (sum(m.breakdown.values()) or 1):.1f}%" for _, m in modes)]
            for c in shown]
    rows.append(["total", *(fmt(sum(m.breakdown.values())) for _, m in modes), *("100.0%" for _ in modes)])
    head = ["category", *(name for name, _ in modes), *(f"% of {name}" for name, _ in modes)]
    return ("<h2>Live at the peak, by category</h2>\n" + svg + "\n"
            + _legend([(_category_name(c), COLOURS[c]) for c in shown]) + "\n" + _table(head, rows, total=True))


def _modules(report: MemoryReport, named: tuple[str, ModeReport], depth: int, fmt: Format) -> str:
    """The per-module table of one mode (``module_rows``), with a bar for the share of its peak."""
    name, mode = named
    rows = module_rows(mode, depth)
    train = mode.mode == "train"
    kept = [r for r in rows if r.params_bytes or r.grads_bytes or r.optimizer_state_bytes
            or r.activations_bytes or r.peak_bytes]
    total = ModuleRow("total", *(sum(getattr(r, f) for r in rows) for f in (
        "params_bytes", "grads_bytes", "optimizer_state_bytes", "activations_bytes", "peak_bytes")))
    head = ["module", "parameters", *(["gradients", "optimizer state", "activations"] if train else []),
            "at peak", "% of peak", ""]
    lines = ["<table>", "<tr>" + "".join(f'<th{" class=num" if i else ""}>{escape(h)}</th>'
                                          for i, h in enumerate(head)) + "</tr>"]
    for row in [*kept, total]:
        share = 100 * row.peak_bytes / mode.peak_bytes if mode.peak_bytes else 0.0
        cells = [fmt(row.params_bytes), *([fmt(row.grads_bytes), fmt(row.optimizer_state_bytes),
                                           fmt(row.activations_bytes)] if train else []),
                 fmt(row.peak_bytes), f"{share:.1f}%"]
        label = row.module if row.module == "total" else _module_name(row.module, report)
        bar = "" if row is total else f'<span class="share" style="width:{min(share, 100):.1f}px"></span>'
        lines.append(f'<tr{" class=total" if row is total else ""}><td>{escape(label)}</td>'
                     + "".join(f"<td class=num>{escape(c)}</td>" for c in cells) + f"<td>{bar}</td></tr>")
    lines.append("</table>")
    return f"<h2>Per module, {escape(name)}, depth {depth}</h2>\n" + "\n".join(lines)


def _ranks(report: MemoryReport, name: str, mode: ModeReport, fmt: Format) -> str:
    """--parallel: the text report's per-GPU table (one row per group of ranks whose memory is the same)."""
    head, rows = rank_rows(mode, fmt)
    world = sum(len(r.ranks) for r in mode.ranks)
    return (f"<h2>Per GPU, {escape(name)} with {escape(report.parallel or '')} ({world} ranks)</h2>\n"
            '<p class="note">One row per group of ranks whose memory is the same; the sizes are those '
            "live at each rank's peak.</p>\n" + _table(head, rows, numeric_from=3))
