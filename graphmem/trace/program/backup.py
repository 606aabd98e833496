"""graphmem run: the program kept whole in a paused process while its model is recorded cut.

Input: the moment the program starts building a block past the first four of a stack
(graphmem.trace.program.stacks).  Output: ``Backup``: a process forked there that waits,
holding the program exactly as it was, while this process goes on with the model cut.  When
the cut recording stands, the backup is killed unused.  When it does not (``Spoiled``: the
recording does not repeat by offset, or the program failed with its model cut), the backup is
told to go on from that moment with the model whole, and its recording comes back here.

So the program starts once: its first lines (imports, reading data, opening a log, moving a
checkpoint aside) run once, whatever the recording tries.  What the cut try did after the fork
is dropped: its files (the backup has its own copy of the program's file layer,
graphmem.trace.program.scratch, as it stood at the fork), and what it printed (held here
until the try stands, then written out; thrown away when it does not).

Only on POSIX (``os.fork``); elsewhere there is no backup and the model is recorded whole.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import IO, Any

from graphmem.errors import TraceError
from graphmem.process import interrupts
from graphmem.process.workers import die_with_parent, how_it_ended

__all__ = ["Backup", "capturing_output"]

_GO, _STOP = b"g", b"s"


class Backup:
    """The paused copy of the program's process (see the module docstring).

    ``fork()`` is called at the cut: it returns True in this process (go on cut) and False in
    the backup (go on whole, once told to; ``fork`` returns only then).  ``in_backup`` says
    which process this is; the backup ends with ``send(kind, value)``.
    """

    def __init__(self, on_backup: Callable[[], None] = lambda: None) -> None:
        self.on_backup = on_backup  # run in the backup when it is told to go on (its file layer detached)
        self.pid = 0
        self.in_backup = False
        self._control = -1  # here: where the go/stop word is written; in the backup: where it is read
        self._results = -1  # here: where the backup's result is read; in the backup: where it is written

    @property
    def made(self) -> bool:
        return self.pid > 0

    def fork(self) -> bool:
        """Fork the backup here.  True: this process, which records the model cut.  False: the
        backup, told to go on with the model whole.  No fork (Windows): False, nothing forked."""
        if not hasattr(os, "fork") or self.in_backup:
            return False
        sys.stdout.flush()
        sys.stderr.flush()
        control_read, control_write = os.pipe()
        results_read, results_write = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid:
            os.close(control_read)
            os.close(results_write)
            self.pid, self._control, self._results = pid, control_write, results_read
            return True
        os.close(control_write)
        os.close(results_read)
        self.in_backup, self._control, self._results = True, control_read, results_write
        die_with_parent(parent)
        word = _read_all(control_read, 1)
        if word != _GO:  # told to stop, or this process's parent is gone
            os._exit(0)
        self.on_backup()
        return False

    def drop(self) -> None:
        """The cut recording stands: the backup ends unused."""
        if not self.made:
            return
        with contextlib.suppress(OSError):
            os.write(self._control, _STOP)
            os.close(self._control)
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self._results)
        self.pid = 0

    def resume(self) -> tuple[str, Any]:
        """The cut recording does not stand: the backup goes on whole; its ("result", value)
        or ("raised", exception), once it has ended."""
        assert self.made, "Backup.resume: no backup was forked"
        os.write(self._control, _GO)
        os.close(self._control)
        chunks: list[bytes] = []
        pid, self.pid = self.pid, 0
        try:
            while True:
                if not select.select([self._results], [], [], 0.05)[0]:
                    interrupts.check()
                    continue
                chunk = os.read(self._results, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
            _, status = os.waitpid(pid, 0)
            pid = 0
        finally:
            os.close(self._results)
            if pid:  # interrupted: the backup stops now
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
        if not chunks:
            raise TraceError(f"the program's process, recording its whole model, ended without a result "
                             f"({how_it_ended(status)})")
        message: tuple[str, Any] = pickle.loads(b"".join(chunks))
        return message

    def send(self, kind: str, value: Any) -> None:
        """In the backup: its result (or what it raised) to the process that resumed it; then it ends."""
        assert self.in_backup, "Backup.send: only the backup sends"
        try:
            data = pickle.dumps((kind, value))
        except Exception:  # broad: an exception that does not pickle is sent as its text
            data = pickle.dumps(("raised", TraceError(f"{type(value).__name__}: {value}")))
        with contextlib.suppress(OSError):
            with os.fdopen(self._results, "wb") as pipe:
                pipe.write(data)
        with contextlib.suppress(BaseException):  # broad: the backup must reach os._exit
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)


def _read_all(fd: int, size: int) -> bytes:
    """Up to ``size`` bytes from ``fd``, waiting (b"" at end of file)."""
    while True:
        try:
            return os.read(fd, size)
        except InterruptedError:
            continue


@contextlib.contextmanager
def capturing_output(files: tuple[IO[bytes], IO[bytes]] | None = None) -> Iterator[Callable[[bool], None]]:
    """Inside, what this process writes to its file descriptors 1 and 2 (the program's prints,
    from Python or C) is held in ``files`` (opened before, empty; default: two temporary
    files); ``keep(True)`` writes it out when the block ends (each to where it was going),
    ``keep(False)`` throws it away.  Kept by default.  The files are closed after."""
    keep = [True]
    sys.stdout.flush()
    sys.stderr.flush()
    saved: dict[int, int] = {}
    try:
        for fd in (1, 2):
            saved[fd] = os.dup(fd)
    except OSError:  # the program closed them: nothing it writes there can be held (nor shown)
        for original in saved.values():
            os.close(original)
        yield lambda kept: None
        return
    held = dict(zip((1, 2), files or (tempfile.TemporaryFile(), tempfile.TemporaryFile()), strict=True))
    for fd, file in held.items():
        os.dup2(file.fileno(), fd)
    try:
        yield lambda kept: keep.__setitem__(0, kept)
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        for fd, original in saved.items():
            os.dup2(original, fd)
            os.close(original)
        for fd, file in held.items():
            if keep[0]:
                file.seek(0)
                while chunk := file.read(1 << 20):
                    _write_all(fd, chunk)
            file.close()


def _write_all(fd: int, data: bytes) -> None:
    """``data`` to ``fd``, whole (a closed or failing descriptor: the rest is dropped)."""
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data):]
