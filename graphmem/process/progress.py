"""Progress of long work, as short phase lines.  Shared by every stage; imports nothing of graphmem.

The stages call ``show("recording the training step: backward, 12,288 ops")`` as they go;
nothing happens unless a sink is installed (``shown_on``): the command line installs one
that writes to stderr (graphmem.cli.process), never to stdout, so results and JSON stay clean.
The library itself never prints.  ``labelled("row 7/18: checkpoint every Block")`` names the
part of a longer command that a block's lines belong to: they read
"row 7/18: checkpoint every Block — recording the training step".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["active", "labelled", "mute", "show", "shown_on"]

_sinks: list[Callable[[str], None]] = []
_labels: list[str] = []  # the parts of the work the lines now belong to, outermost first


def active() -> bool:
    """Whether anyone listens (callers skip building a message otherwise)."""
    return bool(_sinks)


def show(text: str) -> None:
    """Report what is being done now (one short line, no trailing period)."""
    if _sinks:
        _sinks[-1](" — ".join([*_labels, text]))


def mute() -> None:
    """No more lines from this process (a forked child that records beside its parent)."""
    _sinks.clear()


@contextlib.contextmanager
def shown_on(sink: Callable[[str], None]) -> Iterator[None]:
    """Send ``show`` lines to ``sink`` for the block."""
    _sinks.append(sink)
    try:
        yield
    finally:
        _sinks.remove(sink)


@contextlib.contextmanager
def labelled(label: str) -> Iterator[None]:
    """Prefix the block's ``show`` lines with ``label`` (which part of the work they are in)."""
    _labels.append(label)
    try:
        yield
    finally:
        _labels.pop()
