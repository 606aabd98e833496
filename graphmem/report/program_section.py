"""Stage 4: what a program run by ``graphmem run`` did besides its tensors: how it failed, and
the files it wrote (each in its own layer, dropped after the run).  MemoryReport -> text, JSON."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from tabulate import tabulate

from graphmem.memory.results import MemoryReport

__all__ = ["program_failure_line", "program_files_json", "program_files_table"]

_SHOWN = 20  # files listed in the table; the JSON lists them all


def program_failure_line(report: MemoryReport) -> str:
    """The line that says how the program failed after its recorded steps, or ""."""
    if report.program_failed is None:
        return ""
    return f"The program failed: {report.program_failed}\n(the report covers what it ran up to then)"


def program_files_table(report: MemoryReport, fmt: Callable[[int], str]) -> str:
    """The files the program wrote, renamed or deleted, or ""."""
    changes = report.program_files
    if not changes:
        return ""
    rows = [[_shown(c.path), c.action + (f" to {_shown(c.to)}" if c.to else ""),
             fmt(c.size_bytes) if c.action not in ("deleted", "directory created", "directory deleted") else ""]
            for c in changes[:_SHOWN]]
    more = f"\n... and {len(changes) - _SHOWN} more (--format json lists all)" if len(changes) > _SHOWN else ""
    return ("Files the program wrote (kept apart and dropped after the run: your files are unchanged)\n"
            + str(tabulate(rows, headers=["path", "what", "size"], tablefmt="simple")) + more)


def program_files_json(report: MemoryReport) -> dict[str, Any]:
    """``program_failed`` and ``program_files`` for the JSON document (absent when empty)."""
    data: dict[str, Any] = {}
    if report.program_failed is not None:
        data["program_failed"] = report.program_failed
    if report.program_files:
        data["program_files"] = [{"path": c.path, "action": c.action, "size_bytes": c.size_bytes,
                                  **({"to": c.to} if c.to else {})} for c in report.program_files]
    return data


def _shown(path: str) -> str:
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
