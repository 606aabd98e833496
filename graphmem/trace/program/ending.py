"""How a recorded program's run ends, and the words for it (``graphmem run``).

Input: what the program raised or the exit it called, in its own process or in one it forked.
Output: an ``Ending`` (stopped after the steps asked for, or by itself, and how), the program's
error cut to its own lines.  Knows nothing of the recorder.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NoReturn

from graphmem.job.program import Program
from graphmem.patching import patched
from graphmem.trace.program.effects import frame_kind

__all__ = ["Ending", "Exited", "end_forked_child", "exit_message", "exit_status", "exits_caught", "failure",
           "steps_text"]

_real_exit = os._exit  # the program's own os._exit is caught while it runs (exits_caught)


@dataclass
class Ending:
    """How the program's run ended: stopped after the steps asked for, or by itself (and how)."""

    pid: int = field(default_factory=os.getpid)  # the program's process (its forked children are not it)
    stopped: bool = False
    failed: str | None = None  # how it failed after recording steps ("exited with status 1")


class Exited(BaseException):
    """``os._exit(code)`` called by the program's own process: its run ends here."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def exits_caught(ending: Ending) -> Iterator[None]:
    """Inside, ``os._exit`` in the program's own process ends its run as an exception would
    (the recording so far stands; its ``finally`` blocks run); in a process it forked
    (a DataLoader worker, a helper) it exits as always."""
    real = os._exit

    def exit_(code: int) -> NoReturn:
        if os.getpid() == ending.pid:
            raise Exited(code)
        real(code)

    with patched((os, "_exit", exit_)):
        yield


def end_forked_child(exc: BaseException | None) -> NoReturn:
    """A process the program forked (``os.fork`` of its own) ran to the end of the program, or
    raised: it ends as Python would end it, without returning into graphmem's code."""
    code = 0
    if isinstance(exc, SystemExit | Exited):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc, SystemExit):
            exit_message(exc.code)
    elif exc is not None:
        code = 1
        with contextlib.suppress(BaseException):  # broad: the process must end
            traceback.print_exception(exc)
    with contextlib.suppress(BaseException):  # broad: the process must end
        sys.stdout.flush()
        sys.stderr.flush()
    _real_exit(code)


def exit_message(code: object) -> None:
    """What Python prints for ``sys.exit(code)``: a code that is no int is written to stderr."""
    if code is not None and not isinstance(code, int):
        with contextlib.suppress(OSError, ValueError):
            print(code, file=sys.stderr)


def exit_status(code: object) -> str:
    if isinstance(code, int):
        return f"exited with status {code}"
    return f"exited with status 1 ({' '.join(str(code).split())})"


def steps_text(steps: int) -> str:
    return f"{steps} optimizer step{'s' * (steps != 1)}"


def _raising_frame(frames: traceback.StackSummary) -> traceback.FrameSummary | None:
    """The frame that raised, when it is an installed library's or torch's (not graphmem's, not
    Python's own): the line a user looks at after their own."""
    if not frames:
        return None
    last = frames[-1]
    kind = frame_kind(last.filename)
    if kind == "library" or (kind == "torch" and "/torch/" in last.filename and "/graphmem/" not in last.filename):
        return last
    return None


def failure(program: Program, exc: BaseException, steps: int) -> str:
    """The program's error, its traceback cut to the program's own frames (not torch's, not
    graphmem's, not runpy's, not an installed library's), then, where a library or torch
    raised it, the line that did."""
    frames = traceback.extract_tb(exc.__traceback__)
    shown = [f for f in frames if frame_kind(f.filename) == "program"][-5:]
    raised = _raising_frame(frames)
    if raised is not None and (not shown or shown[-1] is not raised):
        shown.append(raised)
    where = "".join(f"\n  {f.filename}:{f.lineno}: {(f.line or '').strip()}" for f in shown)
    after = f" after {steps} optimizer step{'s' * (steps != 1)}"
    return f"{program.command} raised {type(exc).__name__}: {str(exc).strip()}{after}{where}"
