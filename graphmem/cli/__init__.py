"""Stage 7: the command line.  Parsing and exit codes only; the only package that imports click.

Input: argv.  Output: text or JSON on stdout (or --output), files, an exit code.  Every option
that says what is analysed is one shared group (``graphmem.cli.options.job_options``) parsed
into one ``graphmem.job.Job``.  The ``graphmem`` program is ``graphmem.cli.supervisor.main``:
a light process that runs the command in a child of its own (see there); ``main`` here is the
click group itself, imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["main"]

if TYPE_CHECKING:
    from graphmem.cli.group import main


def __getattr__(name: str) -> Any:
    if name != "main":
        raise AttributeError(f"module 'graphmem.cli' has no attribute {name!r}")
    from graphmem.cli.group import main
    return main
