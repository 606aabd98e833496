"""Stage 4: the picture files of one analysis (``--timeline``, ``--snapshot``, ``--dot``).

Input: a MemoryReport and the paths asked for.  Output: the files, all drawn from the same
analysis and the same mode (training when analysed, else inference); nothing is re-traced.
``check_output_path`` validates a path's suffix and the optional dependency it needs, so
the CLI can refuse a bad option before the analysis starts.
"""

from __future__ import annotations

from pathlib import Path

from graphmem.errors import UserInputError
from graphmem.memory.results import MemoryReport
from graphmem.report.dot import COLLAPSE_CHOICES, DOT_FORMATS, require_pydot, write_dot
from graphmem.report.series import drawn_mode
from graphmem.report.snapshot import write_snapshot
from graphmem.report.timeline import TIMELINE_FORMATS, require_matplotlib, write_timeline

__all__ = ["OUTPUT_FORMATS", "check_output_path", "picture_title", "write_files"]

OUTPUT_FORMATS = {"timeline": TIMELINE_FORMATS, "snapshot": ("pickle",), "dot": DOT_FORMATS}


def check_output_path(kind: str, path: str) -> str:
    """``path`` when its suffix suits ``kind`` (timeline, snapshot, dot) and the optional
    dependency that output needs is installed; else UserInputError naming the choices."""
    suffix = Path(path).suffix.lower().lstrip(".")
    formats = OUTPUT_FORMATS[kind]
    if suffix not in formats:
        raise UserInputError(f"{kind} file {path!r}: unknown file type {'.' + suffix if suffix else '(none)'}; "
                             f"expected a file ending in {', '.join('.' + f for f in formats)}")
    if kind == "timeline":
        require_matplotlib()
    if kind == "dot":
        require_pydot()
    return path


def picture_title(report: MemoryReport) -> str:
    """``graphmem: TARGET (INPUTS), MODE``: the title every picture carries."""
    mode = drawn_mode(report)
    what = "inference" if mode.mode == "inference" else f"train ({mode.optimizer})"
    return f"graphmem: {report.target} ({', '.join(report.inputs)}), {what}"


def write_files(report: MemoryReport, *, timeline: str | None = None, snapshot: str | None = None,
                dot: str | None = None, collapse: str = "auto", depth: int = 2, units: str = "auto") -> None:
    """Write each picture whose path is given.

    Args:
        report: the analysis.
        timeline: .svg, .png or .html path for the memory timeline.
        snapshot: .pickle path for the PyTorch memory_viz snapshot.
        dot: .dot/.gv path for DOT text, or .svg/.png/.pdf rendered by Graphviz.
        collapse: ``auto``, ``module`` or ``op`` (the DOT graph's level).
        depth: module-tree depth of the collapsed DOT graph.
        units: units of sizes in the labels.
    """
    if collapse not in COLLAPSE_CHOICES:
        raise UserInputError(f"unknown collapse {collapse!r}; expected one of: {', '.join(COLLAPSE_CHOICES)}")
    for kind, path in (("timeline", timeline), ("snapshot", snapshot), ("dot", dot)):
        if path is not None:
            check_output_path(kind, path)
    mode = drawn_mode(report)
    title = picture_title(report)
    if timeline is not None:
        write_timeline(mode, timeline, title, units)
    if snapshot is not None:
        write_snapshot(mode, snapshot, report.target.rpartition(":")[2] or report.target)
    if dot is not None:
        write_dot(mode, dot, collapse=collapse, depth=depth, units=units, title=title)
