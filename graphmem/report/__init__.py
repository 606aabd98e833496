"""Stage 4: renderers.  ``RENDERERS`` maps each ``--format`` name to its function."""

from __future__ import annotations

from collections.abc import Callable

from graphmem.report.json import render_json, report_to_dict
from graphmem.report.table import render_table
from graphmem.report.units import UNITS, format_bytes
from graphmem.types import MemoryReport

__all__ = ["RENDERERS", "UNIT_CHOICES", "format_bytes", "render_json", "render_table", "report_to_dict"]

RENDERERS: dict[str, Callable[[MemoryReport, str], str]] = {
    "table": render_table,
    "json": render_json,
}

UNIT_CHOICES = ("auto", *UNITS)
