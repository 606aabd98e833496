"""Stage 6, report: renderers only.

Input: a ``MemoryReport`` (and the pre-flight answers).  Output: text, JSON and pictures.
``RENDERERS`` maps each ``--format`` name to its function; the pictures (timeline,
memory_viz snapshot, DOT graph) are written by their own modules.  Never analyses, never
parses the command line.

The names below are imported on first use: the command line checks its options with
``formats`` and ``paths`` (output paths), which import no torch, before anything heavy is
loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphmem._lazy import lazy_exports
from graphmem.units import UNITS, format_bytes

__all__ = [
    "COLLAPSE_CHOICES",
    "DOT_FORMATS",
    "RENDERERS",
    "TIMELINE_FORMATS",
    "UNIT_CHOICES",
    "ModuleRow",
    "Renderer",
    "TopTensor",
    "build_snapshot",
    "check_output_path",
    "drawn_mode",
    "format_bytes",
    "module_rows",
    "render_json",
    "render_table",
    "report_to_dict",
    "top_tensors",
    "write_dot",
    "write_files",
    "write_snapshot",
    "write_timeline",
]

UNIT_CHOICES = ("auto", *UNITS)

if TYPE_CHECKING:
    from graphmem.report.dot import write_dot
    from graphmem.report.files import write_files
    from graphmem.report.formats import COLLAPSE_CHOICES, DOT_FORMATS, TIMELINE_FORMATS
    from graphmem.report.json import render_json, report_to_dict
    from graphmem.report.modules import ModuleRow, TopTensor, module_rows, top_tensors
    from graphmem.report.paths import check_output_path
    from graphmem.report.renderers import RENDERERS, Renderer
    from graphmem.report.series import drawn_mode
    from graphmem.report.snapshot import build_snapshot, write_snapshot
    from graphmem.report.table import render_table
    from graphmem.report.timeline import write_timeline

__getattr__ = lazy_exports(globals(), {
    "graphmem.report.dot": ("write_dot",),
    "graphmem.report.files": ("write_files",),
    "graphmem.report.formats": ("COLLAPSE_CHOICES", "DOT_FORMATS", "TIMELINE_FORMATS"),
    "graphmem.report.json": ("render_json", "report_to_dict"),
    "graphmem.report.modules": ("ModuleRow", "TopTensor", "module_rows", "top_tensors"),
    "graphmem.report.paths": ("check_output_path",),
    "graphmem.report.renderers": ("RENDERERS", "Renderer"),
    "graphmem.report.series": ("drawn_mode",),
    "graphmem.report.snapshot": ("build_snapshot", "write_snapshot"),
    "graphmem.report.table": ("render_table",),
    "graphmem.report.timeline": ("write_timeline",),
})
