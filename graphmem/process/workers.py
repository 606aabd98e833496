"""Independent analyses in forked worker processes, one per core.

Input: a function and the items to call it on; output: its results, in order.  Each call is a
recording of its own (a plan row, one rank of a sharded step), so they run side by side.  The
items reach the workers through the fork (nothing is pickled in); the results are pickled back.
A worker never starts workers of its own: inside one, everything runs one after another.
Ctrl-C stops the workers at once.  ``GRAPHMEM_PROCESSES`` sets how many (1: no workers).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from graphmem.errors import TraceError
from graphmem.process import interrupts

__all__ = ["after_fork", "die_with_parent", "fork_each", "fork_map", "fork_once", "how_it_ended", "processes"]

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


def forked_autograd_works() -> bool:
    """Whether a process forked from this one now can run autograd.  A CPU build of torch always
    can; a CUDA build refuses in a child once this process has recorded a step ("Unable to
    handle autograd's threading in combination with fork-based multiprocessing", seen with
    torch 2.14.1's CUDA build on a machine with no GPU: a second analysis in one Python process
    could not record its ranks in forked workers).  Asked of a forked child."""
    import torch  # the caller has imported it: only a lookup here

    if torch.version.cuda is None and torch.version.hip is None:
        return True
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            weight = torch.ones(1, requires_grad=True)
            (weight * 2).sum().backward()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def after_fork(parent: int) -> None:
    """What every forked worker or rank process does first.

    It runs no parallel region of OpenMP: torch on Linux builds its intra-op parallelism on
    GNU OpenMP, whose thread pool does not survive a fork, so a child forked after its parent
    ran a parallel op waits forever in its first one (torch's DataLoader workers do the same
    for the same reason).  The processes run side by side, one per core, so one thread each
    is what they would use anyway.  And it ends with the process that forked it (Linux), so
    no worker outlives a killed parent (``parent``: its pid, taken before the fork).
    """
    import torch  # the parent has imported it: only a lookup here

    torch.set_num_threads(1)
    die_with_parent(parent)


def die_with_parent(parent: int) -> None:
    """Linux: this process is killed when its parent (pid ``parent``) ends (PR_SET_PDEATHSIG);
    elsewhere nothing.  A parent already gone ends it now."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(ImportError, OSError, AttributeError):  # no ctypes, libc or prctl: not tied to it
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:  # it ended before the call: nobody would wait for this process
        os._exit(1)


def how_it_ended(status: int) -> str:
    """How a process ended, from its wait status (``os.waitpid``): "exited with status 1",
    "killed by SIGSEGV", "killed by SIGKILL (out of memory?)" (Linux's OOM killer sends SIGKILL)."""
    if os.WIFSIGNALED(status):
        return _killed_by(os.WTERMSIG(status))
    if os.WIFEXITED(status):
        return f"exited with status {os.WEXITSTATUS(status)}"
    return f"ended with wait status {status}"


def _killed_by(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    return f"killed by {name}" + (" (out of memory?)" if number == signal.SIGKILL else "")


def _exit_code_ended(exitcode: int | None) -> str:
    """How a ``multiprocessing.Process`` ended, from its ``exitcode`` (-N: killed by signal N)."""
    if exitcode is None:
        return "how it ended is not known"
    return _killed_by(-exitcode) if exitcode < 0 else f"exited with status {exitcode}"


def _died(what: str, how: str) -> TraceError:
    return TraceError(f"a process {what} died without a result: {how}")


def _reported(index: int, result: R, done: Callable[[int, R], None] | None) -> R:
    if done is not None:
        done(index, result)
    return result


def _report_ended(pending: Sequence[Future[R]], reported: set[int], done: Callable[[int, R], None]) -> None:
    """``done`` for each call that ended since the last look (one that raised: raised later)."""
    for index, future in enumerate(pending):
        if index not in reported and future.done() and not future.cancelled() and future.exception() is None:
            reported.add(index)
            done(index, future.result())


def _mark_worker(parent: int) -> None:
    global _IN_WORKER
    _IN_WORKER = True
    after_fork(parent)


def _call(index: int) -> Any:
    assert _PENDING is not None, "fork_map: a worker started without work"
    function, items = _PENDING
    return function(items[index])


def fork_map(function: Callable[[T], R], items: Sequence[T], *, what: str,
             done: Callable[[int, R], None] | None = None) -> list[R]:
    """``[function(item) for item in items]``, the calls in forked worker processes when more
    than one core is there (``what``: what a call does, for the message when a worker dies).
    An exception a call raises is raised here.  ``done(index, result)``, when given, is called
    here (in this process) as each call ends, in the order they end.  In this process, one
    after another, also where a forked process could not run autograd (forked_autograd_works)."""
    workers = min(processes(), len(items))
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods() or not forked_autograd_works():
        return [_reported(n, function(item), done) for n, item in enumerate(items)]
    global _PENDING
    _PENDING = (function, items)
    others = set(multiprocessing.active_children())  # the caller's own child processes: left alone
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_mark_worker,
                               initargs=(os.getpid(),))
    started: set[Any] = set()  # the pool's processes seen so far: which one died, if one does
    try:
        pending = [pool.submit(_call, n) for n in range(len(items))]
        reported: set[int] = set()
        while True:
            started |= set(multiprocessing.active_children()) - others
            waiting = wait(pending, timeout=0.05).not_done
            if done is not None:
                _report_ended(pending, reported, done)
            if not waiting:
                break
            interrupts.check()
        return [p.result() for p in pending]
    except BrokenProcessPool as exc:  # a worker died (killed for memory, a crash): say how, do not hang
        raise TraceError(f"a worker process {what} died: {_pool_death(started)}; run with GRAPHMEM_PROCESSES=1 "
                         "to run them one after another") from exc
    finally:
        for child in set(multiprocessing.active_children()) - others:  # an interrupted analysis stops now
            child.terminate()
        pool.shutdown(wait=True, cancel_futures=True)  # its thread ends before the interpreter does
        _PENDING = None


def _pool_death(started: set[Any]) -> str:
    """How the worker that broke a pool ended, as far as is known: the pool ends the others with
    SIGTERM once one died, so an exit status or another signal names it."""
    ended = []
    for process in started:
        process.join(0.2)
        if process.exitcode not in (None, 0):
            ended.append(process.exitcode)
    first = [code for code in ended if code != -signal.SIGTERM] or ended
    return _exit_code_ended(first[0]) if first else "how it ended is not known"


def _run_forked(function: Callable[[T], R], item: T, sender: Any, parent: int) -> None:
    """A fresh process's one call: its result (or what it raised) sent back whole, with what it
    wrote to ``sys.stdout``."""
    _mark_worker(parent)
    written = io.StringIO()
    try:
        with contextlib.redirect_stdout(written):
            message: tuple[str, Any, str] = ("result", function(item), "")
    except BaseException as exc:  # broad: whatever the call raised is raised in the parent
        message = ("raised", exc, "")
    message = (message[0], message[1], written.getvalue())
    try:
        sender.send(message)
    except Exception:  # broad: an exception that does not pickle is sent as its text
        sender.send(("raised", TraceError(f"{type(message[1]).__name__}: {message[1]}"), message[2]))
    sender.close()


def fork_each(function: Callable[[T], R], items: Sequence[T], *, what: str) -> list[R]:
    """``[function(item) for item in items]``, each call in a process of its own forked from
    this one as it is now (``what``: what a call does, for the message when one dies): no call
    sees what another did to the process (a module one imported, its import-time tensors).  At
    most ``processes()`` at once; one after another in this process where there is no fork
    (or inside a worker).  What a call writes to ``sys.stdout`` is written here when it ends,
    in the order of the items.  An exception a call raises is raised here."""
    if _IN_WORKER or "fork" not in multiprocessing.get_all_start_methods() or not forked_autograd_works():
        return [function(item) for item in items]
    from multiprocessing.connection import wait as wait_for

    context = multiprocessing.get_context("fork")
    results: dict[int, tuple[str, Any, str]] = {}
    running: dict[Any, tuple[int, Any]] = {}  # receiving end -> (index, process)
    receiver: Any
    waiting = list(range(len(items)))
    limit = max(1, processes())
    try:
        while waiting or running:
            while waiting and len(running) < limit:
                index = waiting.pop(0)
                receiver, sender = context.Pipe(duplex=False)
                # not a daemon: a rank's program may start processes of its own (a multiprocessing
                # helper), which multiprocessing refuses a daemon; it dies with this process all the same
                process = context.Process(target=_run_forked, args=(function, items[index], sender, os.getpid()),
                                          daemon=False)
                process.start()
                sender.close()
                running[receiver] = (index, process)
            for receiver in wait_for(list(running), timeout=0.05):
                index, process = running.pop(receiver)
                try:
                    results[index] = receiver.recv()
                except EOFError:  # it died without a word (killed for memory, a crash, os._exit)
                    process.join()
                    results[index] = ("raised", _died(what, _exit_code_ended(process.exitcode)), "")
                process.join()
            for receiver, (index, process) in list(running.items()):
                # ended without a word while a process it started holds its pipe open (no end of file)
                if process.exitcode is not None and not receiver.poll():
                    del running[receiver]
                    receiver.close()
                    results[index] = ("raised", _died(what, _exit_code_ended(process.exitcode)), "")
            interrupts.check()
    finally:
        for _, process in running.values():  # an interrupted run stops now
            process.terminate()
            process.join()
    out = []
    for index in range(len(items)):
        kind, value, written = results[index]
        sys.stdout.write(written)
        if kind == "raised":
            raise value
        out.append(value)
    return out


def fork_once(function: Callable[[], R], *, what: str) -> tuple[str, Any, str] | None:
    """``function()`` in a process forked from this one as it is now, inside a worker too (a
    try that may leave the process unfit to try again: one rank of a program recorded with its
    model cut, graphmem.api.run_program): ("result", its result, what it wrote to
    ``sys.stdout``), or ("raised", the exception, that), or None where there is no fork.
    ``os.fork`` itself: a worker is a daemon process, which multiprocessing lets have none."""
    if not hasattr(os, "fork"):
        return None
    import pickle

    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its result back through the pipe, then gone without running the parent's exit
        os.close(readable)
        code = 0
        try:
            after_fork(parent)
            written = io.StringIO()
            try:
                with contextlib.redirect_stdout(written):
                    message: tuple[str, Any, str] = ("result", function(), "")
            except BaseException as exc:  # broad: whatever the call raised is raised in the parent
                message = ("raised", exc, "")
            try:
                data = pickle.dumps((message[0], message[1], written.getvalue()))
            except Exception:  # broad: an exception that does not pickle is sent as its text
                data = pickle.dumps(("raised", TraceError(f"{type(message[1]).__name__}: {message[1]}"),
                                     written.getvalue()))
            with os.fdopen(writable, "wb") as pipe:
                pipe.write(data)
        except BaseException as exc:  # broad: nothing may escape into the parent's code
            code = 1
            with contextlib.suppress(BaseException):  # broad: as above; stderr may be closed too
                sys.stderr.write(f"graphmem: a process {what} could not send its result: {exc!r}\n")
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(writable)
    chunks: list[bytes] = []
    try:
        with os.fdopen(readable, "rb") as pipe:
            status = _read_until_gone(pipe.fileno(), pid, chunks)
        pid = 0
    finally:
        if pid:  # an interrupted run stops now
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    if not chunks or not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:  # it died without a result
        return ("raised", _died(what, how_it_ended(status)), "")
    result: tuple[str, Any, str] = pickle.loads(b"".join(chunks))
    return result


def _read_until_gone(fd: int, pid: int, chunks: list[bytes]) -> int:
    """Read ``fd`` into ``chunks`` until end of file, or until process ``pid`` has exited and what
    it wrote is read (a process it started may hold the pipe open for ever: no end of file then);
    its wait status, the process reaped."""
    import select

    while True:
        if select.select([fd], [], [], 0.05)[0]:
            chunk = os.read(fd, 1 << 20)
            if chunk:
                chunks.append(chunk)
                continue
            return os.waitpid(pid, 0)[1]  # end of file: it is ending
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            while select.select([fd], [], [], 0)[0] and (chunk := os.read(fd, 1 << 20)):
                chunks.append(chunk)
            return status
        interrupts.check()
