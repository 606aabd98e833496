"""Errors to exit codes: 0 success (check, max-batch: fits); 1 does not fit (check,
max-batch) or, for analyze, a bug; 2 usage errors (bad TARGET, --input, option);
3 the analysis failed (and, for the pre-flight commands, a bug: 1 must only mean "does not fit").
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator

import click

from graphmem.errors import GraphmemError

__all__ = ["errors_to_exit_codes", "preflight_errors"]


@contextlib.contextmanager
def errors_to_exit_codes(debug: bool, bug_exit: int = 1, debug_keeps_code: bool = False) -> Iterator[None]:
    """GraphmemError -> 'Error: ...' with its exit code (2 usage, 3 analysis); a bug -> an
    'internal error' line and ``bug_exit``.  ``--debug`` re-raises (the traceback), or, with
    ``debug_keeps_code``, prints the traceback and keeps the exit code."""
    try:
        yield
    except (click.ClickException, click.exceptions.Exit, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        if debug and not debug_keeps_code:
            raise
        if debug:
            traceback.print_exception(exc)
        if isinstance(exc, GraphmemError):
            error = click.ClickException(str(exc))
            error.exit_code = exc.exit_code  # type: ignore[misc]
            raise error from None
        click.echo(f"Error: internal error: {type(exc).__name__}: {exc} "
                   "(rerun with --debug for the traceback, and please report it)", err=True)
        sys.exit(bug_exit)


def preflight_errors(debug: bool) -> contextlib.AbstractContextManager[None]:
    """As errors_to_exit_codes, but a bug exits 3 (exit 1 means "does not fit") and --debug
    prints the traceback and keeps the exit code."""
    return errors_to_exit_codes(debug, bug_exit=3, debug_keeps_code=True)
