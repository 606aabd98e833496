"""The processes below the ``graphmem`` program's own: what the model's code started ends with the command.

Input: nothing but this process and /proc.  Output: this process made a child subreaper (Linux),
its ended children reaped, and, at the end of the command, every process below it killed and
reaped (``end_descendants``).  Light, as graphmem.cli.supervisor must be: no click, no torch.

A helper process or a subprocess in a session of its own that the model's code started outlives
the child that started it; on Linux such an orphan is reparented to the nearest subreaper above
it, this process, not to init, so the tree below this process holds every one of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

__all__ = ["become_subreaper", "end_descendants", "reap"]

_END_S = 2.0  # the longest the end waits for the processes below this one to be gone
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> None:
    """Linux: orphans below this process are reparented to it, not to init (PR_SET_CHILD_SUBREAPER),
    so that ``end_descendants`` finds and reaps them; elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(ImportError, OSError, AttributeError):  # no ctypes, libc or prctl: not a subreaper
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _parents() -> dict[int, tuple[int, str]]:
    """Every process's parent and state (Linux: /proc/PID/stat); empty without /proc."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as stat:
                    fields = stat.read().rpartition(b")")[2].split()  # after the name, which may hold spaces
            except OSError:  # it ended meanwhile
                continue
            found[int(name)] = (int(fields[1]), fields[0].decode())
    return found


def _descendants(root: int) -> list[int]:
    """The processes below ``root``, zombies included."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in _parents().items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def reap(keep: int = 0) -> None:
    """Reap this process's children that have ended, but ``keep``."""
    me = os.getpid()
    for pid, (parent, state) in _parents().items():
        if parent == me and state in ("Z", "X") and pid != keep:
            with contextlib.suppress(OSError):
                os.waitpid(pid, os.WNOHANG)


def end_descendants() -> None:
    """Kill every process below this one and reap them (orphans are reparented here, see
    ``become_subreaper``), until none is left or ``_END_S`` has passed."""
    me, deadline = os.getpid(), time.monotonic() + _END_S
    while True:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        left = _descendants(me)
        if not left or time.monotonic() > deadline:
            return
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)
