"""The ``graphmem`` program: a light supervising process, the command's work in a child it owns.

A gate must not hang or lie whatever the model's code does, so the process the user (or a CI
runner) starts imports neither torch nor the user's code.  It forks one child, which parses the
command line, imports and builds the model, records the step and renders the result
(graphmem.cli.commands, in-process as click runs it), and hands back over a pipe one JSON line
per progress report and one with the result: the text for stdout and the exit code graphmem
chose.  Nothing is ever unpickled here.  The supervisor alone writes stdout and ends the
process:

- a result came: its text on stdout, its exit code (stdout closed: 141; stdout failing, a full
  disk: 3; an error's own code stands either way: it is on stderr already);
- the child ended without one (``os._exit`` in the model's code, killed for memory, a crash),
  whatever its status: exit 3, naming how it ended;
- SIGINT, SIGTERM or SIGHUP, at any moment before the result came: the child's whole process
  group (its workers and ranks too) and every process below this one are killed at once, the
  temporary folder removed, nothing printed but one line on stderr (and the JSON error document
  with ``--format json``), exit 128 + the signal.  Once the result came, it stands; while its
  writing is blocked (nobody reads the pipe), a signal ends the process with 128 + the signal;
- ``--timeout DURATION`` passed: the same, exit 3, naming the last stage the child reported.

The child (graphmem.cli.child) runs in a process group of its own (a terminal's Ctrl-C reaches
the supervisor only), dies with the supervisor (Linux's parent-death signal), reads stdin from
/dev/null, writes the model's prints to stderr (fd 1 is stderr there; only graphmem's main
thread writes the result), and keeps its temporary files, matplotlib's and inductor's caches in
a folder this process removes.  Its threads end with it: the child exits as soon as the result is
sent.  What the model's code started (a helper process, a subprocess in a session of its own)
ends with the command: on Linux this process is a child subreaper, so every orphan below it is
reparented to it, and at the end it kills and reaps every process below it before removing the
folder (graphmem.cli.descendants).

Closed standard streams (``2>&-``, ``>&-``) are /dev/null here from the first line on, so no
pipe or file takes their numbers, and a closed stderr changes no exit code.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from graphmem.cli.arguments import own_arguments
from graphmem.cli.child import SIGNALS as _SIGNALS
from graphmem.cli.child import run_child
from graphmem.cli.descendants import become_subreaper, end_descendants, reap
from graphmem.process.workers import how_it_ended
from graphmem.units import parse_duration

__all__ = ["main"]

# graphmem.cli.exit_codes' USAGE, FAILED and CLOSED_PIPE (that module imports click); 128 + signal
USAGE, FAILED, CLOSED_PIPE, INTERRUPTED_BASE = 2, 3, 141, 128

def _option(argv: Sequence[str], name: str) -> str | None:
    """The value of ``--name V`` / ``--name=V`` in argv (the last wins, as click's does)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.partition("=")[2]
    return value


class _Supervisor:
    """The one command this process runs: its child, its folder, what the child said."""

    def __init__(self, argv: Sequence[str], stdout_closed: bool = False) -> None:
        own = own_arguments(argv)  # graphmem run's program's options are the program's
        self.as_json = _option(own, "--format") == "json"
        timeout = _option(own, "--timeout")
        try:
            self.timeout_s = parse_duration(timeout) if timeout is not None else None
        except ValueError:  # the child's option parsing says so, as a usage error
            self.timeout_s = None
        self.timeout_text = timeout
        self.stdout_closed = stdout_closed  # closed when graphmem started (``>&-``)
        self.pid = 0
        self.fd = -1  # where the child's messages come from
        self.folder = ""
        self.last_progress = ""
        self.result: dict[str, Any] | None = None
        self.crash = ""  # graphmem's own error outside the command, in the child
        self.pipe_closed = False  # end of file on the result pipe before the child exited
        self.signalled = 0
        self.code: int | None = None  # the result's exit code, once its writing began
        self.unwritten = b""  # what of the result stdout has not taken yet
        self._buffer = b""

    # -- the end of the command -----------------------------------------------------------------
    def cleanup(self) -> None:
        """Kill the child's process group (whatever is left of it) and every process below this
        one, reap them, and remove the folder (after them: none of them writes there again)."""
        if self.pid:
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)
        end_descendants()
        self.pid = 0
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = ""

    def fail(self, kind: str, message: str, code: int) -> NoReturn:
        """End with ``Error: message`` on stderr (and the JSON error document), exit ``code``."""
        self.cleanup()
        _write_within(2, f"Error: {message}\n")
        if self.as_json and not self.stdout_closed:
            document = {"error": {"kind": kind, "message": message, "exit_code": code}}
            _write_within(1, json.dumps(document, indent=2) + "\n")
        os._exit(code)

    def on_signal(self, signum: int, frame: Any) -> None:
        """SIGINT, SIGTERM, SIGHUP: end now, whatever the child is doing (a second one too).
        Once the result came it stands: written in full, its exit code; while stdout does not
        take it (a pipe nobody reads), 128 + the signal, the result cut short."""
        if self.code is not None and not self.unwritten:
            os._exit(self.code)
        if self.code is not None:
            self.cleanup()
            _write_within(2, f"Error: interrupted ({_signal_name(signum)}) while writing the result: standard "
                          "output did not take it (nobody reads it?); the result is cut short\n")
            os._exit(INTERRUPTED_BASE + signum)
        if self.signalled:
            self.cleanup()
            os._exit(INTERRUPTED_BASE + signum)
        self.signalled = signum
        self.drain()
        if self.complete():  # the command had ended: its result stands
            self.finish(0)
        self.fail("interrupted", f"interrupted ({_signal_name(signum)}): stopped before the result was written",
                  INTERRUPTED_BASE + signum)

    # -- the child's messages -------------------------------------------------------------------
    def read(self, fd: int, wait_s: float) -> bool:
        """Read what the child sent within ``wait_s``; False at end of file.  The signals wait
        while a chunk is taken in: their handler reads on from there (``drain``)."""
        ready, _, _ = select.select([fd], [], [], wait_s)
        if not ready:
            return True
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return False
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                self.take(line)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return True

    def take(self, line: bytes) -> None:
        """One message of the child: progress, its result or graphmem's own crash."""
        with contextlib.suppress(ValueError):
            message = json.loads(line)
            if isinstance(message, dict) and isinstance(message.get("progress"), str):
                self.last_progress = message["progress"]
            elif isinstance(message, dict) and isinstance(message.get("result"), dict):
                self.result = message["result"]
            elif isinstance(message, dict) and isinstance(message.get("crash"), str):
                self.crash = message["crash"]

    def drain(self) -> None:
        """Read what the child has sent and this process not yet read (its result, maybe)."""
        with contextlib.suppress(OSError, ValueError):
            while self.fd >= 0 and select.select([self.fd], [], [], 0)[0] and self.read(self.fd, 0):
                pass

    def complete(self) -> bool:
        """Whether the child's result came, whole."""
        result = self.result
        return result is not None and isinstance(result.get("stdout"), str) and isinstance(result.get("exit"), int)

    def wait(self, fd: int) -> int:
        """Relay until the child has exited, or has sent its result and had a second to exit;
        its wait status.  Its process group is killed before it is reaped (its pid, the group's
        id, cannot have been reused yet).  A process the child started may hold the pipe open:
        the child's end, not the pipe's, ends the wait."""
        started = time.monotonic()
        open_, result_at, reaped_at = True, 0.0, started
        while True:
            if open_:
                open_ = self.read(fd, 0.05)
                self.pipe_closed = not open_
            else:  # end of file: the child is ending
                time.sleep(0.01)
            now = time.monotonic()
            result_at = result_at or (now if self.result is not None else 0.0)
            if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None or (
                    result_at and now - result_at > 1.0):
                while open_ and select.select([fd], [], [], 0)[0] and self.read(fd, 0):
                    pass
                with contextlib.suppress(OSError):
                    os.killpg(self.pid, signal.SIGKILL)
                _, status = os.waitpid(self.pid, 0)
                self.pid = 0
                return status
            if self.timeout_s is not None and now - started > self.timeout_s:
                where = f"it was at: {self.last_progress}" if self.last_progress else \
                    "it had not reported any stage yet (importing or building the model)"
                self.fail("analysis", f"timed out after {self.timeout_text} (--timeout); {where}", FAILED)
            if now - reaped_at > 1.0:  # orphans of the model's processes, reparented here
                reap(keep=self.pid)
                reaped_at = now

    def finish(self, status: int) -> NoReturn:
        """Write the result and exit with its code; without one, exit 3 saying how the child ended."""
        if self.crash:
            self.fail("internal", f"internal error: {self.crash} (rerun with --debug for the traceback, and please "
                      "report it)", FAILED)
        if not self.complete():
            self.fail("analysis", f"the analysis ended without a result: {self.how_it_ended(status)}; "
                      "rerun with --debug to see its traceback, or with --timeout if it hangs", FAILED)
        assert self.result is not None, "_Supervisor.finish: complete() without a result"
        text, code = self.result["stdout"], int(self.result["exit"])
        self.cleanup()
        code = self.write(text, code)
        os._exit(code)

    def write(self, text: str, code: int) -> int:
        """Write the result's text to stdout; the exit code then.  Where stdout was closed (a
        reader gone, ``>&-``) an answer (0, 1) becomes 141, where it failed (a full disk) 3 with
        one line saying so; an error's own code stands (its message is on stderr already)."""
        if not text:
            return code
        if self.stdout_closed:
            return code if code >= USAGE else CLOSED_PIPE
        try:
            data = text.encode(getattr(sys.stdout, "encoding", None) or "utf-8")
        except (UnicodeEncodeError, LookupError):
            data = text.encode("utf-8", "replace")
        self.unwritten, self.code = data, code  # from here on a signal changes nothing once it is written
        try:
            while self.unwritten:
                self.unwritten = self.unwritten[os.write(1, self.unwritten):]
        except BrokenPipeError:
            self.code, self.unwritten = code if code >= USAGE else CLOSED_PIPE, b""
        except OSError as exc:
            self.code, self.unwritten = code if code >= USAGE else FAILED, b""
            if code < USAGE:
                _write_within(2, f"Error: could not write the result to standard output: {exc.strerror or exc}\n")
        return self.code

    def how_it_ended(self, status: int) -> str:
        """How the child ended without a result: "its process exited with status 1 before sending
        one (...)", "its process was killed by SIGSEGV"."""
        if not os.WIFEXITED(status):
            return f"its process was {how_it_ended(status)}"
        why = ("it closed the pipe graphmem reads the result from: does the model's code close file descriptors "
               "it did not open?" if self.pipe_closed else "the model's code called os._exit?")
        return f"its process {how_it_ended(status)} before sending one ({why})"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _write_within(fd: int, text: str, seconds: float = 1.0) -> None:
    """Write ``text`` to ``fd`` unless it does not take it within ``seconds`` (a pipe nobody
    reads): an error message must not keep the process from ending."""
    data = text.encode("utf-8", "replace")
    deadline = time.monotonic() + seconds
    with contextlib.suppress(OSError, ValueError):
        while data:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                return
            data = data[os.write(fd, data[:select.PIPE_BUF]):]  # a pipe with room takes PIPE_BUF bytes at once


def _standard_streams() -> bool:
    """Open /dev/null on any of file descriptors 0, 1, 2 that is closed, so that no pipe or file
    takes its number and what is written there goes nowhere; True when stdout was closed."""
    closed = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            closed.append(fd)
    if 1 in closed or sys.stdout is None:
        sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False)
    if 2 in closed or sys.stderr is None:
        sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False)
    return 1 in closed


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``graphmem`` program (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not hasattr(os, "fork"):  # no fork (Windows): the command runs here, unsupervised
        from graphmem.cli.group import main as group
        group.main(args, prog_name="graphmem")
        raise SystemExit(0)
    stdout_closed = _standard_streams()
    run = _Supervisor(args, stdout_closed)
    for signum in _SIGNALS:
        signal.signal(signum, run.on_signal)
    become_subreaper()
    run.folder = tempfile.mkdtemp(prefix="graphmem-")
    read_fd, write_fd = os.pipe()
    supervisor = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        run_child(args, write_fd, run.folder, supervisor)
    run.pid = pid
    with contextlib.suppress(OSError):  # as the child does: no window where it has our group
        os.setpgid(pid, pid)
    os.close(write_fd)
    run.fd = read_fd
    status = run.wait(read_fd)
    run.finish(status)
