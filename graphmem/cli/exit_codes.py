"""Exit codes, and every failure of a command mapped to one (the table: docs/exit-codes.md).

0 success (check: fits; max-batch / max-seq: some value fits); 1 only "does not fit" (check,
max-batch, max-seq), never an error; 2 usage error; 3 the analysis could not be done (its
error, or a bug in graphmem); 130 interrupted (SIGINT); 141 standard output closed.

A failure has a kind, one of ``KINDS``: usage (2), analysis (3), internal (3: a bug),
interrupted (130).  It is shown as ``Error: ...`` on stderr and, with ``--format json``, as
``{"error": {"kind", "message", "exit_code"}}`` on stdout (graphmem.cli.process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import click

from graphmem.errors import GraphmemError

__all__ = ["CLOSED_PIPE", "DOES_NOT_FIT", "FAILED", "INTERRUPTED", "KINDS", "SUCCESS", "USAGE", "CommandError",
           "CommandExit", "as_command_error", "errors_to_exit_codes"]

SUCCESS = 0         # analyze, plan: done; check: fits; max-batch / max-seq: some value fits
DOES_NOT_FIT = 1    # check: does not fit; max-batch / max-seq: not even 1 fits.  Never an error.
USAGE = 2           # bad TARGET, option or input; TARGET exits while imported or built; unwritable path
FAILED = 3          # the analysis could not be done: trace / unsupported errors, unwritable result, bugs
INTERRUPTED = 130   # SIGINT (Ctrl-C), 128 + 2 as shells report it
CLOSED_PIPE = 141   # stdout closed before the result was written, 128 + SIGPIPE (13)

KINDS = {"usage": USAGE, "analysis": FAILED, "internal": FAILED, "interrupted": INTERRUPTED}


class CommandError(click.ClickException):
    """A command's failure: its kind (a key of KINDS), message and exit code.

    Args:
        kind: usage, analysis, internal or interrupted.
        message: one line: what happened and how to fix it.
        debug: show the traceback of the cause (``--debug``).
    """

    def __init__(self, kind: str, message: str, *, debug: bool = False) -> None:
        super().__init__(message)
        self.kind, self.debug = kind, debug
        self.exit_code = KINDS[kind]  # type: ignore[misc]  # a ClassVar in click's stubs; set per instance


class CommandExit(SystemExit):
    """How a failed command ends: ``SystemExit(code)`` whose text is the error's message."""

    def __init__(self, error: CommandError) -> None:
        super().__init__(error.exit_code)
        self.error = error

    def __str__(self) -> str:
        return self.error.message


@contextlib.contextmanager
def errors_to_exit_codes(debug: bool) -> Iterator[None]:
    """Around the work of a command (where the user's code runs): every exception except an
    interrupt leaves as a CommandError.  GraphmemError: usage (its exit code 2) or analysis;
    the user's code exiting (SystemExit) during the analysis: analysis; anything else is a
    bug: internal.  ``--debug`` shows the traceback, the exit code stays."""
    try:
        yield
    except (KeyboardInterrupt, CommandError):
        raise
    except GraphmemError as exc:
        kind = "usage" if exc.exit_code == USAGE else "analysis"
        raise CommandError(kind, str(exc), debug=debug) from exc
    except SystemExit as exc:  # graphmem never exits here: the model's code did
        raise CommandError("analysis", f"the model's code exited during the analysis (SystemExit({exc.code!r})); "
                           "graphmem cannot analyse code that calls sys.exit", debug=debug) from exc
    except BaseException as exc:  # a bug: even a ClickException here must not exit 1
        raise CommandError("internal", _internal(exc), debug=debug) from exc


def _internal(exc: BaseException) -> str:
    said = " ".join(str(exc).split())  # one line, whatever the exception's text
    return f"internal error: {type(exc).__name__}: {said} (rerun with --debug for the traceback, and please report it)"


def as_command_error(exc: BaseException, interrupted: bool) -> CommandError:
    """The failure an exception that reached the command line's top stands for.

    Args:
        exc: the exception (not a SystemExit: those end the process as they are).
        interrupted: a SIGINT was seen during the command, whatever happened after it.
    """
    if interrupted or isinstance(exc, (KeyboardInterrupt, click.Abort)):
        return CommandError("interrupted", "interrupted (SIGINT): stopped before the result was written")
    if isinstance(exc, CommandError):
        return exc
    if isinstance(exc, click.ClickException):  # click's own: bad options, files, ...
        return CommandError("usage", exc.format_message())
    return CommandError("internal", _internal(exc))
