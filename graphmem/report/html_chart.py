"""Stage 4: the memory timeline drawn into the one-page report (``--html``) as inline SVG.

Input: one analysed mode, the ``--units``, the budget, and what the page says about the peak
(what the GPU must hold there, the peak's module for people).  Output: the SVG chart as text:
live bytes after every op as a polyline, phases shaded, the peak marked, the budget as a line,
and on the CUDA target what the GPU must hold as a dotted line, with its legend below.

Timelines of more than ``MAX_POINTS`` ops are drawn from the highest op of each run of ops
(``series.bucket_peaks``), so the page stays small for big models and the peak is never
lost.  Every piece of text goes through ``html.escape``.  Pure; no plotting library.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from graphmem.memory.results import ModeReport
from graphmem.preflight.budget import Budget
from graphmem.report.series import bucket_peaks, phase_spans
from graphmem.report.timeline import PHASE_SHADES
from graphmem.units import UNITS, format_bytes

__all__ = ["MAX_POINTS", "SHADES", "decimate", "legend", "timeline_svg"]

MAX_POINTS = 2000
# the timeline picture's phase colours, and the two phases of --generate
SHADES = {**PHASE_SHADES, "prefill": "#e3e6f5", "decode": "#fbf0d0"}

# the chart's drawing area inside its viewBox (SVG user units)
_WIDTH, _HEIGHT = 1000, 300
_LEFT, _RIGHT, _TOP, _BOTTOM = 78, 16, 26, 34


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


def timeline_svg(mode: ModeReport, units: str, budget: Budget | None, *, on_gpu: int | None, peak_module: str) -> str:
    """Live bytes after each op as a polyline over the shaded phases, the peak marked (with
    ``peak_module``, its module for people), the budget as a dashed line when it is within
    twice the peak (else named below), and on the CUDA target ``on_gpu``, what the GPU must hold
    at its peak, as a dotted line (what the budget is compared with; None elsewhere)."""
    limit = budget.total_bytes if budget is not None else None
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
    parts.append(_peak_marker(mode, peak_module, scale, units))
    parts.append("</svg>")
    present = dict.fromkeys(span.phase for span in phase_spans(mode.trace.ops))
    shades = legend([(f"{phase} phase", SHADES.get(phase, "#eeeeee")) for phase in present])
    note = ""
    if limit is not None and shown is None and budget is not None:
        note = (f'<p class="note">The budget ({escape(budget.source)}) is {escape(format_bytes(limit, units))}, '
                f"{limit / max(data_top, 1):.1f} times this peak: its line is above the chart.</p>")
    return "\n".join(parts) + "\n" + shades + note


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


def _peak_marker(mode: ModeReport, module: str, scale: _Scale, units: str) -> str:
    """A red marker on the peak and its bytes, op, module and phase beside it."""
    peak = mode.peak
    x, y = scale.x(peak.step), scale.y(mode.peak_bytes)
    right_half = peak.step > len(mode.timeline) / 2
    anchor, dx = ("end", -10) if right_half else ("start", 10)
    lines = [f"peak {format_bytes(mode.peak_bytes, units)} after op {peak.step}",
             f"{peak.op_name} in {module}",
             f"{peak.phase} (iteration {peak.iteration + 1})"]
    text = "".join(f'<tspan x="{round(x + dx, 1)}" dy="{0 if i == 0 else 14}">{escape(line)}</tspan>'
                   for i, line in enumerate(lines))
    return (f'<g class="peak"><circle cx="{x}" cy="{y}" r="5" fill="#b00020"/>'
            f'<text x="{round(x + dx, 1)}" y="{y + 18}" text-anchor="{anchor}" '
            f'font-weight="600" stroke="#fff" stroke-width="4" paint-order="stroke">{text}</text></g>')


def legend(items: Sequence[tuple[str, str]]) -> str:
    """Coloured swatches, each with its label (a chart's legend)."""
    spans = "".join(f'<span class="swatch" style="background:{colour}"></span>{escape(label)}'
                    for label, colour in items)
    return f'<p class="legend">{spans}</p>'
