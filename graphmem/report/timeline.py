"""Stage 4: the memory timeline picture.  ModeReport -> SVG, PNG or HTML (matplotlib).

Input: one ModeReport (training when analysed, else inference).
Output: live bytes after every op, stacked by category, with the phases shaded (forward,
loss, backward, optimizer, per iteration) and the peak marked with its op and module.
Each pixel column of the plot is drawn at the highest op it covers (``series.column_peaks``,
at most ``MAX_POINTS`` columns), so an op narrower than a pixel (the one-op spike of a
foreach optimizer kernel in a step of 100,000 ops) still reaches its height: the top of the
drawn stack at the peak's column is the peak.  The stack is drawn without antialiasing so a
one-pixel column is painted whole, not blended away.
matplotlib is an optional dependency (``pip install graphmem[viz]``), imported here only.
"""

from __future__ import annotations

import io
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

from graphmem.errors import UserInputError
from graphmem.memory.results import Category, ModeReport
from graphmem.report.formats import TIMELINE_FORMATS, require_matplotlib
from graphmem.report.modules import ROOT, op_module
from graphmem.report.series import Column, PhaseSpan, category_timelines, column_peaks, phase_spans
from graphmem.units import UNITS, format_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "DPI",
    "MAX_POINTS",
    "TIMELINE_FORMATS",
    "render_timeline",
    "require_matplotlib",
    "timeline_figure",
    "write_timeline",
]

MAX_POINTS = 3000  # at most this many columns, however wide the plot
DPI = 110  # pixels per inch of the figure and of the PNG
# bottom to top: what stays for the whole step first, what comes and goes on top
STACK_ORDER = (Category.PARAMETER, Category.BUFFER, Category.INPUT, Category.OPTIMIZER_STATE,
               Category.GRADIENT, Category.COMMUNICATION, Category.ACTIVATION, Category.OUTPUT, Category.TEMPORARY)
COLOURS = {Category.PARAMETER: "#4c72b0", Category.BUFFER: "#8172b3", Category.INPUT: "#937860",
           Category.OPTIMIZER_STATE: "#55a868", Category.GRADIENT: "#c44e52",
           Category.ACTIVATION: "#dd8452", Category.OUTPUT: "#da8bc3", Category.TEMPORARY: "#8c8c8c",
           Category.COMMUNICATION: "#64b5cd"}
_MARKER_SIZE = 9  # points
PHASE_SHADES = {"forward": "#e3eefa", "loss": "#f1e4f5", "backward": "#fdeadb", "optimizer": "#e6f4e1"}


def timeline_figure(mode: ModeReport, title: str, units: str = "auto") -> Figure:
    """The timeline as a matplotlib Figure (no pyplot state is touched).

    Args:
        mode: the mode to draw.
        title: the figure title.
        units: units of the y axis (``auto`` picks the peak's unit).
    """
    require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    unit = _axis_unit(mode.peak_bytes, units)
    scale = UNITS[unit]  # plot in the axis unit so the ticks fall on round numbers
    _shade_phases(ax, phase_spans(mode.trace.ops), len(mode.timeline))
    _mark_peak(fig, ax, mode, units, scale)
    ax.set_ylabel(f"live bytes ({unit})")
    ax.set_xlabel("op (execution order)")
    ax.set_xlim(-0.5, len(mode.timeline) - 0.5)
    ax.set_ylim(0, mode.peak_bytes / scale * 1.22 or 1)
    ax.set_title(title, loc="left")
    series = category_timelines(mode)
    shown = [c for c in STACK_ORDER if any(series[c])]
    phases, _ = ax.get_legend_handles_labels()
    fig.legend(handles=[*phases, *_swatches(shown)], loc="outside right upper", fontsize="small", frameon=False)
    fig.draw_without_rendering()  # lays the figure out: the plot's width in pixels is known now
    columns = max(1, min(MAX_POINTS, round(ax.get_window_extent().width)))
    _stack(ax, series, shown, column_peaks(mode.timeline, columns), scale)
    return fig


def _axis_unit(peak: int, units: str) -> str:
    if units != "auto":
        return units
    return next((u for u in reversed(UNITS) if peak >= UNITS[u]), "B")


def _swatches(shown: list[Category]) -> list[Any]:
    """Legend entries of the stacked categories (drawn before the stack, which needs the layout)."""
    from matplotlib.patches import Patch

    return [Patch(facecolor=COLOURS[c], linewidth=0, label=str(c)) for c in shown]


def _stack(ax: Axes, series: dict[Category, tuple[int, ...]], shown: list[Category],
           columns: tuple[Column, ...], scale: int) -> None:
    """Stacked areas per category, one step per column at its highest op (``column_peaks``)."""
    edges = [c.start for c in columns] + [columns[-1].end]
    picks = [c.op for c in columns] + [columns[-1].op]  # step="post": the last edge closes the last column
    ax.stackplot(edges, [[series[c][i] / scale for i in picks] for c in shown], step="post",
                 colors=[COLOURS[c] for c in shown], linewidth=0, antialiased=False)


def _shade_phases(ax: Axes, spans: tuple[PhaseSpan, ...], num_ops: int) -> None:
    """Shade each phase run and name the wide ones; a dashed line where an iteration starts."""
    labelled: set[str] = set()
    for span in spans:
        label = None if span.phase in labelled else f"{span.phase} phase"
        labelled.add(span.phase)
        ax.axvspan(span.start - 0.5, span.end + 0.5, color=PHASE_SHADES.get(span.phase, "#eeeeee"),
                   zorder=0, linewidth=0, label=label)
        if span.end - span.start + 1 >= 0.05 * num_ops:
            ax.text((span.start + span.end) / 2, 0.985, f"{span.phase} {span.iteration + 1}",
                    transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize="small",
                    color="#555555")
        if span.iteration > 0 and span.phase == "forward" and span.start > 0:
            ax.axvline(span.start - 0.5, color="#777777", linestyle="--", linewidth=0.8, zorder=1)


def _mark_peak(fig: Figure, ax: Axes, mode: ModeReport, units: str, scale: int) -> None:
    """A marker whose tip touches the peak and a note naming its op, module, phase and iteration."""
    from matplotlib.transforms import offset_copy

    peak = mode.peak
    module = op_module(mode.trace, peak.step)
    module = "(root module)" if module == ROOT else module
    note = (f"peak {format_bytes(mode.peak_bytes, units)} after op {peak.step}\n{peak.op_name}\n"
            f"{module}, {peak.phase} (iteration {peak.iteration + 1})")
    right_half = peak.step > len(mode.timeline) / 2
    # above the peak, not on it: a marker centred on the peak would hide the top of a narrow spike
    above = offset_copy(ax.transData, fig=fig, y=_MARKER_SIZE / 2, units="points")
    ax.plot([peak.step], [mode.peak_bytes / scale], marker="v", color="#b00020", markersize=_MARKER_SIZE,
            markeredgewidth=0, zorder=5, linestyle="none", transform=above)
    ax.annotate(note, xy=(peak.step, mode.peak_bytes / scale), xytext=(-12 if right_half else 12, -6),
                textcoords="offset points", ha="right" if right_half else "left", va="top",
                fontsize="small", zorder=6,
                bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "#b00020", "alpha": 0.9})


def render_timeline(mode: ModeReport, fmt: str, title: str, units: str = "auto") -> bytes:
    """The timeline as file content in ``fmt`` (one of ``TIMELINE_FORMATS``)."""
    if fmt not in TIMELINE_FORMATS:
        raise UserInputError(f"unknown timeline format {fmt!r}; expected one of: {', '.join(TIMELINE_FORMATS)}")
    fig = timeline_figure(mode, title, units)
    buffer = io.BytesIO()
    from matplotlib import rc_context

    with rc_context({"svg.fonttype": "none"}):  # SVG text stays text: searchable, and smaller
        fig.savefig(buffer, format="png" if fmt == "png" else "svg", dpi=110, metadata=_metadata(fmt))
    if fmt != "html":
        return buffer.getvalue()
    svg = buffer.getvalue().decode("utf-8")
    svg = svg[svg.index("<svg"):]  # drop the XML prolog and doctype to inline it
    return _html_page(title, mode, units, svg).encode("utf-8")


def _metadata(fmt: str) -> dict[str, Any]:
    # no creation date: the same analysis writes the same file
    return {"Software": "graphmem"} if fmt == "png" else {"Date": None, "Creator": "graphmem"}


def _html_page(title: str, mode: ModeReport, units: str, svg: str) -> str:
    peak = mode.peak
    summary = (f"peak {format_bytes(mode.peak_bytes, units)} after op {peak.step} of {len(mode.timeline)}: "
               f"{peak.op_name} in {peak.module or '(root module)'}, {peak.phase} (iteration {peak.iteration + 1})")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title></head>\n<body style=\"font-family: sans-serif\">\n"
            f"<h1 style=\"font-size: 1.2em\">{escape(title)}</h1>\n<p>{escape(summary)}</p>\n{svg}\n</body></html>\n")


def write_timeline(mode: ModeReport, path: str | Path, title: str, units: str = "auto") -> None:
    """Write the timeline to ``path``; its suffix (.svg, .png, .html) picks the format."""
    fmt = Path(path).suffix.lower().lstrip(".")
    content = render_timeline(mode, fmt, title, units)
    Path(path).write_bytes(content)
