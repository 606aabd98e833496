"""Stage 4: the "where the memory goes" sections of the table output.

Input: a MemoryReport (the mode drawn: training when analysed, else inference).
Output: text sections (tabulate): the live-bytes sparkline, the per-module table cut at
``depth`` levels of the module tree with its total row, and the ``top`` largest storages
live at the peak.  The numbers come from ``graphmem.report.modules``.
"""

from __future__ import annotations

from collections.abc import Callable

from tabulate import tabulate

from graphmem.memory.results import MemoryReport, ModeReport
from graphmem.report.modules import ROOT, ModuleRow, TopTensor, module_rows, top_tensors
from graphmem.report.series import drawn_mode
from graphmem.report.sparkline import render_sparkline
from graphmem.units import format_bytes

__all__ = ["module_table", "render_module_sections", "top_tensor_table"]

Format = Callable[[int], str]


def render_module_sections(report: MemoryReport, units: str = "auto", depth: int = 2, top: int = 10) -> list[str]:
    """The sparkline, per-module and top-tensor sections for the drawn mode.

    Args:
        report: the analysis.
        units: units of sizes (``auto``, ``B``, ``KiB``, ...).
        depth: levels of the module tree shown (deeper modules add to their ancestor).
        top: how many of the largest storages live at the peak to list (0: none).
    """
    mode = drawn_mode(report)
    fmt: Format = lambda n: format_bytes(n, units)
    root = report.target.rpartition(":")[2] or report.target
    title = "inference" if mode.mode == "inference" else f"train ({mode.optimizer})"
    parts = [render_sparkline(mode, units),
             f"Per module, {title}, depth {depth}\n" + module_table(mode, depth, fmt, root)]
    if top > 0:
        parts.append(f"Top {top} tensors live at the peak, {title} (op {mode.peak.step})\n"
                     + top_tensor_table(mode, top, fmt, root))
    return parts


def module_table(mode: ModeReport, depth: int, fmt: Format, root: str = "") -> str:
    """Rows per module and a total row; training adds gradients, optimizer state, activations."""
    rows = module_rows(mode, depth)
    train = mode.mode == "train"
    head = ["module", "parameters"] + (["gradients", "optimizer state", "activations"] if train else [])
    head += ["at peak", "% of peak"]
    # rows with no byte in any column (a module that only made views) are left out
    body = [_module_cells(r, fmt, train, mode.peak_bytes, root) for r in rows
            if r.params_bytes or r.grads_bytes or r.optimizer_state_bytes or r.activations_bytes or r.peak_bytes]
    total = ModuleRow("total", sum(r.params_bytes for r in rows), sum(r.grads_bytes for r in rows),
                      sum(r.optimizer_state_bytes for r in rows), sum(r.activations_bytes for r in rows),
                      sum(r.peak_bytes for r in rows))
    body.append(_module_cells(total, fmt, train, mode.peak_bytes, root))
    return str(tabulate(body, headers=head, tablefmt="simple", disable_numparse=True))


def _module_cells(row: ModuleRow, fmt: Format, train: bool, peak: int, root: str) -> list[str]:
    cells = [_module_name(row.module, root), fmt(row.params_bytes)]
    if train:
        cells += [fmt(row.grads_bytes), fmt(row.optimizer_state_bytes), fmt(row.activations_bytes)]
    share = f"{100 * row.peak_bytes / peak:.1f}%" if peak else "-"
    return cells + [fmt(row.peak_bytes), share]


def top_tensor_table(mode: ModeReport, count: int, fmt: Format, root: str = "") -> str:
    """The ``count`` largest storages live at the peak: size, shape, what made them, when they die."""
    body = []
    for t in top_tensors(mode, count):
        body.append([fmt(t.nbytes), "x".join(map(str, t.shape)) or "scalar", t.dtype, str(t.category),
                     t.label or "-", _made_by(t, mode), _module_name(t.module, root),
                     _dies(t, mode)])
    head = ["size", "shape", "dtype", "category", "name", "made by", "module", "dies"]
    return str(tabulate(body, headers=head, tablefmt="simple", disable_numparse=True))


def _module_name(module: str, root: str) -> str:
    return f"(root {root})" if module == ROOT and root else module


def _made_by(t: TopTensor, mode: ModeReport) -> str:
    if t.created < 0:
        return "(before the step)"
    line = mode.trace.ops[t.created].line if t.created < len(mode.trace.ops) else ""
    return f"{t.op} (op {t.created})" + (f" at {line}" if line else "")


def _dies(t: TopTensor, mode: ModeReport) -> str:
    if t.dies is None:
        return "kept after the step"
    op = mode.trace.ops[t.dies]
    return f"after op {t.dies} ({op.phase}, iteration {op.iteration + 1})"
