"""Errors raised by graphmem.

User mistakes (bad target, bad shape, bad option) are ``UserInputError``; failures while
recording or analysing a model that was given correctly are ``TraceError`` or
``UnsupportedError``; a result that could not be written is ``OutputError``.  The CLI maps
the first to exit code 2 and the others to exit code 3 (docs/exit-codes.md).
"""

from __future__ import annotations

__all__ = ["GraphmemError", "UserInputError", "TraceError", "UnsupportedError", "OutputError"]


class GraphmemError(Exception):
    """Root of every error graphmem raises on purpose."""

    exit_code = 3


class UserInputError(GraphmemError):
    """The user asked for something invalid: a bad target, shape, dtype or option."""

    exit_code = 2


class TraceError(GraphmemError):
    """The model could not be recorded (data-dependent control flow, a failing op, ...)."""

    exit_code = 3


class UnsupportedError(GraphmemError):
    """The model uses a feature graphmem does not model."""

    exit_code = 3


class OutputError(GraphmemError):
    """A result or picture file could not be written (disk full, folder removed meanwhile)."""

    exit_code = 3
