"""Stage 6: the ``--format`` renderers by name.  MemoryReport -> text (table) or JSON.

``RENDERERS`` maps each name the command line's ``--format`` offers
(graphmem.report.formats.RENDERER_NAMES) to its function.
"""

from __future__ import annotations

from typing import Protocol

from graphmem.memory.results import MemoryReport
from graphmem.report.header import Settings
from graphmem.report.json import render_json
from graphmem.report.table import render_table

__all__ = ["RENDERERS", "Renderer"]


class Renderer(Protocol):
    """A ``--format`` renderer: the report, the units of sizes, the module-tree depth, how
    many top tensors the "where the memory goes" sections show, and the job's settings that
    change its numbers (shown in the header and the JSON; None: only what the report shows)."""

    def __call__(self, report: MemoryReport, units: str = "auto", *, depth: int = 2, top: int = 10,
                 setup: Settings | None = None) -> str: ...


RENDERERS: dict[str, Renderer] = {
    "table": render_table,
    "json": render_json,
}
