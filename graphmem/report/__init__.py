"""Stage 6, report: renderers only.

Input: a ``MemoryReport`` (and the pre-flight answers).  Output: text, JSON and pictures.
``RENDERERS`` maps each ``--format`` name to its function; the pictures (timeline,
memory_viz snapshot, DOT graph) are written by their own modules.  Never analyses, never
parses the command line.
"""

from __future__ import annotations

from typing import Protocol

from graphmem.memory.results import MemoryReport
from graphmem.report.dot import COLLAPSE_CHOICES, DOT_FORMATS, write_dot
from graphmem.report.files import check_output_path, write_files
from graphmem.report.header import Setup
from graphmem.report.json import render_json, report_to_dict
from graphmem.report.modules import ModuleRow, TopTensor, module_rows, top_tensors
from graphmem.report.series import drawn_mode
from graphmem.report.snapshot import build_snapshot, write_snapshot
from graphmem.report.table import render_table
from graphmem.report.timeline import TIMELINE_FORMATS, write_timeline
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


class Renderer(Protocol):
    """A ``--format`` renderer: the report, the units of sizes, the module-tree depth, how
    many top tensors the "where the memory goes" sections show, and the job's settings that
    change its numbers (shown in the header and the JSON; None: only what the report shows)."""

    def __call__(self, report: MemoryReport, units: str = "auto", *, depth: int = 2, top: int = 10,
                 setup: Setup | None = None) -> str: ...


RENDERERS: dict[str, Renderer] = {
    "table": render_table,
    "json": render_json,
}

UNIT_CHOICES = ("auto", *UNITS)
