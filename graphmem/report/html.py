"""Stage 4: the one-page report (``--html``).  MemoryReport -> one self-contained HTML page.

Input: a MemoryReport (and the ``--units`` and ``--depth`` of the command).
Output: a str holding one page that needs nothing else to open: no script, no external
style sheet, font or picture.  It shows the facts of the text header (model, parameters,
inputs, loss, optimizer, device and GPU), whether the step fits its budget (the GPU's memory
when ``--gpu`` names one: what the device must hold, as ``graphmem check`` compares it, on
the CUDA target the caching allocator's reserved peak plus the CUDA context and NCCL's
buffers), the peaks and where they happen, the memory timeline of each analysed mode (inline
SVG, ``graphmem.report.html_chart``: live bytes after every op as a polyline, phases shaded,
the peak marked, the budget as a line, and on the CUDA target what the GPU must hold as a
dotted line), the categories live at each peak, the per-module table
(``graphmem.report.modules``) and, with ``--parallel``, the per-rank table.

Every piece of text goes through ``html.escape``.  Pure; no plotting library.
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
from graphmem.report.html_chart import MAX_POINTS, decimate, legend, timeline_svg
from graphmem.report.modules import ROOT, ModuleRow, module_rows
from graphmem.report.parallel_section import rank_rows
from graphmem.report.paths import check_html_path
from graphmem.report.timeline import COLOURS, STACK_ORDER
from graphmem.units import format_bytes

__all__ = ["HTML_SUFFIXES", "MAX_POINTS", "check_html_path", "decimate", "render_html"]

Format = Callable[[int], str]

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
        needed, allocated = _needed_bytes(report, mode)
        body.append(timeline_svg(mode, units, budget, on_gpu=needed if allocated is not None else None,
                                 peak_module=_module_name(mode.peak.module, report, mode.peak.phase)))
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
            + legend([(_category_name(c), COLOURS[c]) for c in shown]) + "\n" + _table(head, rows, total=True))


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
