"""The child the ``graphmem`` program runs the command in (graphmem.cli.supervisor forks it).

Input: the command line, the pipe to the supervising process, the temporary folder it removes.
Output: over the pipe, one JSON line per progress report and one with the result (the text for
stdout and the exit code graphmem chose), or one naming graphmem's own crash; then ``os._exit``.
The command runs in-process as click runs it (graphmem.cli.group, imported here on first use).

The child runs in a process group of its own, dies with the supervisor (Linux's parent-death
signal), takes the default action of the signals the supervisor handles, reads stdin from
/dev/null, writes the model's prints to stderr (fd 1 is stderr here; only graphmem's main
thread writes the result) and keeps its temporary files and caches in the folder.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from graphmem.process.workers import die_with_parent

__all__ = ["SIGNALS", "run_child"]

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # the supervisor ends the command on these


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


def run_child(argv: Sequence[str], write_fd: int, folder: str, parent: int) -> NoReturn:
    """Run the command; send the progress lines and the result to ``write_fd``; exit."""
    send = _sender(write_fd)
    status = 0
    try:
        _isolate(folder, parent)
        stdout = _Stdout(sys.stderr)
        sys.stdout = stdout
        code = _run_command(argv, send)
        result = {"result": {"stdout": stdout.kept.getvalue(), "exit": code}}
    except BaseException as exc:  # broad: graphmem's own failure outside the command: the supervisor says so
        import traceback
        with contextlib.suppress(OSError, ValueError):  # a closed stderr: the crash is still sent
            traceback.print_exc()
        with contextlib.suppress(OSError):  # the supervisor is gone: nobody to tell
            send({"crash": f"{type(exc).__name__}: {' '.join(str(exc).split())}"})
    else:
        try:
            send(result)
        except OSError as exc:  # the model's code closed the pipe (or the supervisor is gone)
            status = 1
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(f"graphmem: the result could not be sent to the supervising process: {exc}\n")
    finally:
        with contextlib.suppress(BaseException):  # broad: a forked child must reach os._exit, whatever happens
            sys.stderr.flush()
        os._exit(status)


def _isolate(folder: str, parent: int) -> None:
    """The child's own process group, death with the supervisor, signals at their defaults,
    stdin from /dev/null, fd 1 to stderr, temporary files and caches in ``folder``, no network
    for Hugging Face, and the current directory no longer first on sys.path (PYTHONPATH's stay)."""
    os.setpgid(0, 0)
    die_with_parent(parent)  # graphmem.process.workers: light, torch only on use
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    if devnull != 0:
        os.dup2(devnull, 0)
        os.close(devnull)
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    os.dup2(2, 1)
    caches = {"TMPDIR": "", "MPLCONFIGDIR": "matplotlib", "TORCHINDUCTOR_CACHE_DIR": "inductor",
              "TRITON_CACHE_DIR": "triton", "XDG_CACHE_HOME": "cache"}
    for variable, sub in caches.items():
        os.environ[variable] = os.path.join(folder, sub) if sub else folder
    tempfile.tempdir = folder
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[variable] = "1"
    sys.path[:] = _without_the_current_folder(sys.path)


def _without_the_current_folder(path: Sequence[str]) -> list[str]:
    """``path`` (sys.path) without the current folder, which python puts first for ``python -m
    graphmem``, so that a ``transformers.py`` there is not imported in place of the real one
    (graphmem.job.load adds it back after the installed packages for a target).  An entry
    PYTHONPATH gives is kept where it stands, as python keeps it, even when it is the current
    folder (a program run from a folder it also puts on PYTHONPATH imports its modules there)."""
    here = os.path.realpath(os.getcwd())
    text = os.environ.get("PYTHONPATH", "")
    given = {os.path.realpath(entry or os.curdir) for entry in text.split(os.pathsep)} if text else set()  # "": here
    pythons = 0 if getattr(sys.flags, "safe_path", False) else 1  # python's own first entry, -P aside
    return [entry for n, entry in enumerate(path)
            if os.path.realpath(entry or os.curdir) != here or (n >= pythons and here in given)]


def _sender(fd: int) -> Callable[[dict[str, Any]], None]:
    def send(message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(fd, data):]
    return send


def _progress(send: Callable[[dict[str, Any]], None], text: str) -> None:
    """Hand a progress line on; a pipe the model's code closed fails the result, not the command."""
    with contextlib.suppress(OSError):
        send({"progress": text})


def _run_command(argv: Sequence[str], send: Callable[[dict[str, Any]], None]) -> int:
    """The command, as click runs it in-process; its exit code."""
    from graphmem.cli import process
    from graphmem.cli.group import main as group

    process.relay_progress(lambda text: _progress(send, text))
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
