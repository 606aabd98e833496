"""One command as a process: interrupts, standard output, closed pipes, the error document.

The exit codes are graphmem.cli.exit_codes' (table: docs/exit-codes.md).  ``GraphmemGroup``
runs every command so that:

- Ctrl-C (SIGINT) exits 130 and writes no result.  For the command's duration the SIGINT
  handler records the interrupt and asks the analysis to stop (graphmem.process.interrupts); the
  analysis raises KeyboardInterrupt at its next safe point (before every recorded op, between
  stages), never inside a callback that C++ runs, where Python would ignore it or the process
  would abort.  A second Ctrl-C ends the process at once, with 130.  The record is checked
  again before any result is written and before the process exits, so an interrupted
  ``check`` can never print FITS and exit 0.  (A Ctrl-C while Python is still importing
  torch, before graphmem runs, kills the process by SIGINT: shells report 130 for that too.)
- The user's code prints to stderr (``user_output_to_stderr``): stdout carries the result
  only.  With ``--format json`` stdout carries exactly one JSON document, also on failure:
  ``{"error": {"kind": ..., "message": ..., "exit_code": N}}``.
- A closed stdout (``graphmem analyze ... | head -1``) ends the command quietly with 141.
- Progress (graphmem.process.progress) goes to stderr: on a terminal, one line rewritten in place once
  the command has run for two seconds, cleared at the end; elsewhere only with --progress, one
  line each.  Never on stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import click

from graphmem.cli.arguments import own_arguments
from graphmem.cli.exit_codes import CLOSED_PIPE, INTERRUPTED, CommandError, CommandExit, as_command_error
from graphmem.process import interrupts, progress

__all__ = ["GraphmemGroup", "print_result", "raise_if_interrupted", "relay_progress",
           "set_progress", "user_output_to_stderr"]

PROGRESS_AFTER_S = 2.0  # work shorter than this shows no progress


class _ClosedStdout(Exception):
    """stdout was closed before the result was written (not an OSError: click would exit 1)."""


class _Run:
    """The command running now, as the SIGINT handler sees it (signals are process-wide)."""

    interrupted = False   # a SIGINT arrived, whether or not its KeyboardInterrupt got through
    wrote_stdout = False  # the result started going to stdout: no error document may follow
    progress: bool | None = None  # --progress / --no-progress; None: on a terminal only
    relay: Callable[[str], None] | None = None  # also hands every progress line on (the supervisor)


def relay_progress(relay: Callable[[str], None]) -> None:
    """Hand every progress line to ``relay`` too, shown or not (graphmem.cli.supervisor: a
    --timeout names the stage the command had reached)."""
    _Run.relay = relay


def set_progress(ctx: Any, param: Any, value: bool | None) -> None:
    """The --progress/--no-progress callback."""
    _Run.progress = value


class _StderrProgress:
    """graphmem.process.progress's sink for a command (see the module docstring)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.in_place = False  # a line is on the terminal, to be rewritten or cleared

    def __call__(self, text: str) -> None:
        if _Run.relay is not None:
            _Run.relay(text)
        terminal = _isatty(sys.stderr)
        if not (_Run.progress if _Run.progress is not None else terminal):
            return
        elapsed = time.monotonic() - self.start
        if elapsed < PROGRESS_AFTER_S:
            return
        line = f"graphmem: [{self.elapsed_text(elapsed)}] {text}"
        with contextlib.suppress(OSError, ValueError):
            if terminal:
                sys.stderr.write(f"\r\x1b[K{line}")
                self.in_place = True
            else:
                sys.stderr.write(f"{line}\n")
            sys.stderr.flush()

    @staticmethod
    def elapsed_text(seconds: float) -> str:
        """The time since the command started: "7s", "1m12s", "2h05m"."""
        whole = int(seconds)
        if whole < 60:
            return f"{whole}s"
        if whole < 3600:
            return f"{whole // 60}m{whole % 60:02d}s"
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"

    def close(self) -> None:
        if self.in_place:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write("\r\x1b[K")
                sys.stderr.flush()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def _on_sigint(signum: int, frame: Any) -> None:
    if _Run.interrupted:  # the second Ctrl-C: the user will not wait for a safe point
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write("\nError: interrupted (SIGINT, twice): stopped at once\n")
            sys.stderr.flush()
        os._exit(INTERRUPTED)
    _Run.interrupted = True
    interrupts.request()


@contextlib.contextmanager
def _interrupts_recorded() -> Iterator[None]:
    """Install ``_on_sigint`` for the block (only the main thread may set signal handlers)."""
    _Run.interrupted = _Run.wrote_stdout = False
    interrupts.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if a SIGINT arrived during this command, even one swallowed since."""
    if _Run.interrupted:
        raise KeyboardInterrupt


def user_output_to_stderr() -> contextlib.AbstractContextManager[Any]:
    """While the user's code runs (import, construction, the recorded step): its prints go
    to stderr, so that stdout carries graphmem's result alone."""
    return contextlib.redirect_stdout(sys.stderr)


def print_result(text: str) -> None:
    """Write the result to stdout, unless interrupted; a closed stdout ends the command (141)."""
    raise_if_interrupted()
    _Run.wrote_stdout = True
    try:
        click.echo(text, nl=False)
    except BrokenPipeError as exc:
        raise _ClosedStdout from exc


def _asks_for_json(argv: Sequence[str]) -> bool:
    """Whether the command line asks for ``--format json`` (read before parsing, so that a
    usage error is reported as JSON too); the last --format wins, as click's does.  Only
    graphmem's own options count (``graphmem run``'s program's ``--format json`` is its own:
    graphmem.cli.arguments)."""
    fmt, own = None, own_arguments(argv)
    for i, arg in enumerate(own):
        if arg == "--format" and i + 1 < len(own):
            fmt = own[i + 1]
        elif arg.startswith("--format="):
            fmt = arg.partition("=")[2]
    return fmt == "json"


def _show(error: CommandError, cause: BaseException, as_json: bool) -> None:
    """``Error: ...`` (click's usage text for usage errors) on stderr; the JSON document on stdout."""
    with contextlib.suppress(OSError, ValueError):  # a closed stderr must not change the exit code
        if error.debug and error.__cause__ is not None:
            traceback.print_exception(error.__cause__)
        if isinstance(cause, click.UsageError) and error.kind == "usage":
            cause.show()
        else:
            click.echo(f"Error: {error.message}", err=True)
    if as_json and not _Run.wrote_stdout:
        document = {"error": {"kind": error.kind, "message": error.message, "exit_code": error.exit_code}}
        with contextlib.suppress(OSError, ValueError):
            click.echo(json.dumps(document, indent=2))


def _click_saw_closed_stdout() -> bool:
    """click, on a broken pipe outside our writes (--help), wraps stdout in its private
    ``_PacifyFlushWrapper`` and exits 1."""
    return type(sys.stdout).__name__.endswith("PacifyFlushWrapper")


def _closed_stdout() -> NoReturn:
    """Exit 141 without Python's "Exception ignored ... BrokenPipeError" when it flushes stdout."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(CLOSED_PIPE)


class GraphmemGroup(click.Group):
    """The ``graphmem`` group: runs a command with the guarantees of this module."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:  # a caller that handles errors itself gets click's behaviour
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        _Run.progress = None
        sink = _StderrProgress()
        with _interrupts_recorded():
            try:
                with progress.shown_on(sink):
                    try:
                        code = super().main(argv, prog_name, complete_var, False, **extra)
                    finally:
                        sink.close()
                raise_if_interrupted()
            except SystemExit:
                if _Run.interrupted:
                    self._fail(KeyboardInterrupt(), argv)
                if _click_saw_closed_stdout():  # e.g. --help | head -1: click exits 1 there
                    _closed_stdout()
                raise
            except _ClosedStdout:
                _closed_stdout()
            except BaseException as exc:  # everything else ends as one error with its exit code
                self._fail(exc, argv)
        sys.exit(code or 0)

    @staticmethod
    def _fail(exc: BaseException, argv: Sequence[str]) -> NoReturn:
        error = as_command_error(exc, _Run.interrupted)
        _show(error, exc, _asks_for_json(argv))
        raise CommandExit(error) from None
