"""The report's output names, without its renderers: what the command line offers and checks
while it parses its options, before anything heavy (torch, matplotlib, networkx) is imported.

Input: nothing.  Output: the ``--format`` names, each picture's file types, the DOT graph's
levels, and whether the optional package (or Graphviz's ``dot`` program) a picture needs is
installed.  The renderers and writers (renderers, timeline, dot, html) import these names from
here; tests/unit/cli/test_cli_startup.py keeps ``RENDERER_NAMES`` equal to ``RENDERERS``' keys.
"""

from __future__ import annotations

import shutil

from graphmem.errors import UserInputError

__all__ = ["COLLAPSE_CHOICES", "DOT_FORMATS", "HTML_SUFFIXES", "RENDERED_DOT_FORMATS", "RENDERER_NAMES",
           "TIMELINE_FORMATS", "require_graphviz", "require_matplotlib", "require_pydot"]

RENDERER_NAMES = ("table", "json")  # --format of analyze and run: graphmem.report.RENDERERS' keys
TIMELINE_FORMATS = ("svg", "png", "html")
COLLAPSE_CHOICES = ("auto", "module", "op")
DOT_FORMATS = ("dot", "gv", "svg", "png", "pdf")
RENDERED_DOT_FORMATS = ("svg", "png", "pdf")  # drawn by Graphviz's `dot` program; .dot and .gv are its text
HTML_SUFFIXES = (".html", ".htm")


def require_matplotlib() -> None:
    """Raise UserInputError naming the extra when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise UserInputError("--timeline needs matplotlib, which is not installed; "
                             "install it with: pip install 'graphmem[viz]'") from exc


def require_pydot() -> None:
    """Raise UserInputError naming the extra when pydot is not installed."""
    try:
        import pydot  # noqa: F401
    except ImportError as exc:
        raise UserInputError("--dot needs pydot, which is not installed; install it with: "
                             "pip install 'graphmem[viz]'") from exc


def require_graphviz(fmt: str) -> str:
    """The path of Graphviz's ``dot`` program, which draws a ``fmt`` (svg, png, pdf) graph;
    UserInputError saying how to install it when it is not on PATH."""
    program = shutil.which("dot")
    if program is None:
        raise UserInputError(f"writing a .{fmt} graph needs Graphviz's `dot` program, which is not on PATH; "
                             "install Graphviz (apt-get install graphviz, brew install graphviz) or write a .dot file")
    return program
