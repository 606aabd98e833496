"""Ctrl-C at safe points.  Shared by every stage; imports nothing of graphmem.

A KeyboardInterrupt raised wherever Python happens to be when SIGINT arrives can land in
Python code that C++ called (a torch callback, a destructor): there it is ignored, or it ends
the process with std::terminate (SIGABRT).  So the command line's SIGINT handler only calls
``request()``, and the long-running stages call ``check()`` where an exception is safe: before
every recorded op and between stages.  A second SIGINT ends the process at once (exit 130).
"""

from __future__ import annotations

__all__ = ["check", "clear", "request", "requested"]

_requested = False


def request() -> None:
    """Ask the running analysis to stop at its next safe point (the SIGINT handler calls this)."""
    global _requested
    _requested = True


def requested() -> bool:
    """Whether a stop was asked for since the last ``clear()``."""
    return _requested


def clear() -> None:
    """Forget earlier requests (a command starts)."""
    global _requested
    _requested = False


def check() -> None:
    """Raise KeyboardInterrupt here if a stop was asked for."""
    if _requested:
        raise KeyboardInterrupt
