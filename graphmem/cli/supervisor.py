"""The ``graphmem`` program: a light supervising process, the command's work in a child it owns.

A gate must not hang or lie whatever the model's code does, so the process the user (or a CI
runner) starts imports neither torch nor the user's code.  It forks one child, which parses the
command line, imports and builds the model, records the step and renders the result
(graphmem.cli.commands, in-process as click runs it), and hands back over a pipe one JSON line
per progress report and one with the result: the text for stdout and the exit code graphmem
chose.  Nothing is ever unpickled here.  The supervisor alone writes stdout and ends the
process:

- a result came: its text on stdout, its exit code;
- the child ended without one (``os._exit`` in the model's code, killed for memory, a crash),
  whatever its status: exit 3, naming how it ended;
- SIGINT, SIGTERM or SIGHUP, at any moment: the child's whole process group (its workers and
  ranks too) is killed at once, the temporary folder removed, nothing printed but one line on
  stderr (and the JSON error document with ``--format json``), exit 128 + the signal;
- ``--timeout DURATION`` passed: the same, exit 3, naming the last stage the child reported.

The child runs in a process group of its own (a terminal's Ctrl-C reaches the supervisor only),
dies with the supervisor (Linux's parent-death signal), reads stdin from /dev/null, writes the
model's prints to stderr (fd 1 is stderr there; only graphmem's main thread writes the result),
and keeps its temporary files, matplotlib's and inductor's caches in a folder this process
removes.  Its threads end with it: the child exits as soon as the result is sent.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from graphmem.units import parse_duration
from graphmem.workers import die_with_parent

__all__ = ["main"]

FAILED, INTERRUPTED_BASE = 3, 128  # graphmem.cli.exit_codes' FAILED; 128 + signal, as shells report it
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


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

    def __init__(self, argv: Sequence[str]) -> None:
        self.as_json = _option(argv, "--format") == "json"
        timeout = _option(argv, "--timeout")
        try:
            self.timeout_s = parse_duration(timeout) if timeout is not None else None
        except ValueError:  # the child's option parsing says so, as a usage error
            self.timeout_s = None
        self.timeout_text = timeout
        self.pid = 0
        self.folder = ""
        self.last_progress = ""
        self.result: dict[str, Any] | None = None
        self.crash = ""  # graphmem's own error outside the command, in the child
        self.signalled = 0
        self._buffer = b""

    # -- the end of the command -----------------------------------------------------------------
    def cleanup(self) -> None:
        """Kill the child's process group (whatever is left of it) and remove the folder."""
        if self.pid:
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def fail(self, kind: str, message: str, code: int) -> NoReturn:
        """End with ``Error: message`` on stderr (and the JSON error document), exit ``code``."""
        self.cleanup()
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(f"Error: {message}\n")
            sys.stderr.flush()
        if self.as_json:
            document = {"error": {"kind": kind, "message": message, "exit_code": code}}
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.write(json.dumps(document, indent=2) + "\n")
                sys.stdout.flush()
        os._exit(code)

    def on_signal(self, signum: int, frame: Any) -> None:
        """SIGINT, SIGTERM, SIGHUP: end now, whatever the child is doing (a second one too)."""
        if self.signalled:
            self.cleanup()
            os._exit(INTERRUPTED_BASE + signum)
        self.signalled = signum
        self.fail("interrupted", f"interrupted ({_signal_name(signum)}): stopped before the result was written",
                  INTERRUPTED_BASE + signum)

    # -- the child's messages -------------------------------------------------------------------
    def read(self, fd: int, wait_s: float) -> bool:
        """Read what the child sent within ``wait_s``; False at end of file."""
        ready, _, _ = select.select([fd], [], [], wait_s)
        if not ready:
            return True
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return False
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                if isinstance(message, dict) and isinstance(message.get("progress"), str):
                    self.last_progress = message["progress"]
                elif isinstance(message, dict) and isinstance(message.get("result"), dict):
                    self.result = message["result"]
                elif isinstance(message, dict) and isinstance(message.get("crash"), str):
                    self.crash = message["crash"]
        return True

    def wait(self, fd: int) -> int:
        """Relay until the child has exited; its wait status.  Its process group is killed
        before it is reaped (its pid, the group's id, cannot have been reused yet)."""
        started = time.monotonic()
        open_ = True
        while True:
            if open_:
                open_ = self.read(fd, 0.05)
            else:  # end of file: the child is ending
                time.sleep(0.01)
            if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                while open_ and select.select([fd], [], [], 0)[0] and self.read(fd, 0):
                    pass
                with contextlib.suppress(OSError):
                    os.killpg(self.pid, signal.SIGKILL)
                _, status = os.waitpid(self.pid, 0)
                self.pid = 0
                return status
            if self.timeout_s is not None and time.monotonic() - started > self.timeout_s:
                where = f"it was at: {self.last_progress}" if self.last_progress else \
                    "it had not reported any stage yet (importing or building the model)"
                self.fail("analysis", f"timed out after {self.timeout_text} (--timeout); {where}", FAILED)

    def finish(self, status: int) -> NoReturn:
        """Write the result and exit with its code; without one, exit 3 saying how the child ended."""
        result = self.result
        if self.crash:
            self.fail("internal", f"internal error: {self.crash} (rerun with --debug for the traceback, and please "
                      "report it)", FAILED)
        if result is None or not isinstance(result.get("stdout"), str) or not isinstance(result.get("exit"), int):
            self.fail("analysis", f"the analysis ended without a result: {_how_it_ended(status)}; "
                      "rerun with --debug to see its traceback, or with --timeout if it hangs", FAILED)
        signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)  # the result is written: a signal now changes nothing
        self.cleanup()
        try:
            sys.stdout.write(result["stdout"])
            sys.stdout.flush()
        except BrokenPipeError:
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            os._exit(141)
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os._exit(int(result["exit"]))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _how_it_ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        why = " (out of memory?)" if number == signal.SIGKILL else ""
        return f"its process was killed by {_signal_name(number)}{why}"
    code = os.WEXITSTATUS(status)
    return f"its process exited with status {code} before writing one (the model's code called os._exit?)"


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``graphmem`` program (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not hasattr(os, "fork"):  # no fork (Windows): the command runs here, unsupervised
        from graphmem.cli.group import main as group
        group.main(args, prog_name="graphmem")
        raise SystemExit(0)
    run = _Supervisor(args)
    for signum in _SIGNALS:
        signal.signal(signum, run.on_signal)
    run.folder = tempfile.mkdtemp(prefix="graphmem-")
    read_fd, write_fd = os.pipe()
    supervisor = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(args, write_fd, run.folder, supervisor)
    run.pid = pid
    with contextlib.suppress(OSError):  # as the child does: no window where it has our group
        os.setpgid(pid, pid)
    os.close(write_fd)
    status = run.wait(read_fd)
    run.finish(status)


# ---------------------------------------------------------------------------------------------
# The child


class _Stdout(io.TextIOBase):
    """The child's ``sys.stdout``: what graphmem's main thread writes is kept for the result;
    any other thread's writes (a model's) go to stderr."""

    def __init__(self, stderr: Any) -> None:
        self.kept = io.StringIO()
        self.stderr = stderr
        self.main = threading.main_thread()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        if threading.current_thread() is self.main:
            return self.kept.write(text)
        return int(self.stderr.write(text))

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stderr.flush()


def _child(argv: Sequence[str], write_fd: int, folder: str, parent: int) -> NoReturn:
    """Run the command; send the progress lines and the result to ``write_fd``; exit."""
    send = _sender(write_fd)
    try:
        _isolate(folder, parent)
        stdout = _Stdout(sys.stderr)
        sys.stdout = stdout
        code = _run_command(argv, send)
        send({"result": {"stdout": stdout.kept.getvalue(), "exit": code}})
    except BaseException as exc:  # broad: graphmem's own failure outside the command: the supervisor says so
        import traceback
        with contextlib.suppress(OSError, ValueError):  # a closed stderr: the crash is still sent
            traceback.print_exc()
        with contextlib.suppress(OSError):  # the supervisor is gone: nobody to tell
            send({"crash": f"{type(exc).__name__}: {' '.join(str(exc).split())}"})
    finally:
        with contextlib.suppress(BaseException):  # broad: a forked child must reach os._exit, whatever happens
            sys.stderr.flush()
        os._exit(0)


def _isolate(folder: str, parent: int) -> None:
    """The child's own process group, death with the supervisor, signals at their defaults,
    stdin from /dev/null, fd 1 to stderr, temporary files and caches in ``folder``, no network
    for Hugging Face, and the current directory no longer first on sys.path."""
    os.setpgid(0, 0)
    die_with_parent(parent)  # graphmem.workers: light, torch only on use
    for signum in _SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout.flush()
    os.dup2(2, 1)
    caches = {"TMPDIR": "", "MPLCONFIGDIR": "matplotlib", "TORCHINDUCTOR_CACHE_DIR": "inductor",
              "TRITON_CACHE_DIR": "triton", "XDG_CACHE_HOME": "cache"}
    for variable, sub in caches.items():
        os.environ[variable] = os.path.join(folder, sub) if sub else folder
    tempfile.tempdir = folder
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[variable] = "1"
    here = {"", os.getcwd()}
    sys.path[:] = [entry for entry in sys.path if entry not in here]


def _sender(fd: int) -> Callable[[dict[str, Any]], None]:
    def send(message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(fd, data):]
    return send


def _run_command(argv: Sequence[str], send: Callable[[dict[str, Any]], None]) -> int:
    """The command, as click runs it in-process; its exit code."""
    from graphmem.cli import process
    from graphmem.cli.group import main as group

    process.relay_progress(lambda text: send({"progress": text}))
    try:
        group.main(list(argv), prog_name="graphmem")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        sys.stderr.write(f"{code}\n")
        return 1
    return 0
