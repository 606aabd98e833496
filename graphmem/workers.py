"""Independent analyses in forked worker processes, one per core.

Input: a function and the items to call it on; output: its results, in order.  Each call is a
recording of its own (a plan row, one rank of a sharded step), so they run side by side.  The
items reach the workers through the fork (nothing is pickled in); the results are pickled back.
A worker never starts workers of its own: inside one, everything runs one after another.
Ctrl-C stops the workers at once.  ``GRAPHMEM_PROCESSES`` sets how many (1: no workers).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from graphmem import interrupts
from graphmem.errors import TraceError

__all__ = ["fork_map", "processes"]

T = TypeVar("T")
R = TypeVar("R")

# what the forked workers call (set before the pool forks)
_PENDING: tuple[Callable[[Any], Any], Sequence[Any]] | None = None
_IN_WORKER = False


def processes() -> int:
    """Worker processes for independent analyses: the cores this process may use
    (``GRAPHMEM_PROCESSES`` overrides; 1 runs them one after another; inside a worker, 1)."""
    if _IN_WORKER:
        return 1
    text = os.environ.get("GRAPHMEM_PROCESSES", "")
    if text.strip().isdigit() and int(text) >= 1:
        return int(text)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _mark_worker() -> None:
    global _IN_WORKER
    _IN_WORKER = True


def _call(index: int) -> Any:
    assert _PENDING is not None, "fork_map: a worker started without work"
    function, items = _PENDING
    return function(items[index])


def fork_map(function: Callable[[T], R], items: Sequence[T], *, what: str) -> list[R]:
    """``[function(item) for item in items]``, the calls in forked worker processes when more
    than one core is there (``what``: what a call does, for the message when a worker dies).
    An exception a call raises is raised here."""
    workers = min(processes(), len(items))
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [function(item) for item in items]
    global _PENDING
    _PENDING = (function, items)
    others = set(multiprocessing.active_children())  # the caller's own child processes: left alone
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_mark_worker)
    try:
        pending = [pool.submit(_call, n) for n in range(len(items))]
        while wait(pending, timeout=0.05).not_done:
            interrupts.check()
        return [p.result() for p in pending]
    except BrokenProcessPool as exc:  # a worker died (killed for memory): say so, do not hang
        raise TraceError(f"a worker process {what} died (out of memory?); run with GRAPHMEM_PROCESSES=1 "
                         "to run them one after another") from exc
    finally:
        for child in set(multiprocessing.active_children()) - others:  # an interrupted analysis stops now
            child.terminate()
        pool.shutdown(wait=True, cancel_futures=True)  # its thread ends before the interpreter does
        _PENDING = None
