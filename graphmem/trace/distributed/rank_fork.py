"""ZeRO-1's ranks recorded from one shared beginning.

Every rank of DDP + ZeroRedundancyOptimizer runs the same forward and backward; the ranks
differ from the first optimizer step on, where each updates (and keeps the state of) its own
partition of the parameters.  So the step is recorded once up to that point; there the process
forks one child per other rank, which builds that rank's optimizer and records the rest of the
step.  What a child records is what recording its rank from the start records (the tests
compare the two op for op); it sends its result back through a file and exits.  No more than
``at_once`` processes record at once (graphmem.process.workers.processes: one per core).

Input: the other ranks (the tracer adds, per rank, the values its optimizer reads).  Output:
per rank, what its child sent (graphmem.trace.ranks.record_ranks gathers them).
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from graphmem.errors import TraceError
from graphmem.process import interrupts, progress
from graphmem.process.workers import after_fork

__all__ = ["RankFork"]


class RankFork:
    """The children recording the other ranks (a process manager, not a frozen record).

    ``rank`` is None in the process that starts them, and the child's own rank in a child.
    """

    def __init__(self, ranks: Sequence[int], at_once: int = 1) -> None:
        self.ranks = tuple(ranks)
        self.reads: dict[int, list[Any]] = {}  # rank -> the values its optimizer step reads (the tracer's)
        self.at_once = max(1, at_once)  # processes recording at once, this one included
        self.rank: int | None = None
        self.started = False
        self._folder = ""
        self._path = ""  # in a child: where its result goes
        self._children: list[tuple[int, int, str]] = []  # (pid, rank, result file), still running
        self._ended: list[tuple[int, str, int]] = []  # (rank, result file, exit status)

    def split(self) -> int | None:
        """Fork a child per other rank (the first time only): None here, its rank in a child.
        Here, this waits while ``at_once`` processes record (1: each child records alone)."""
        if self.started:
            return None
        self.started = True
        self._folder = tempfile.mkdtemp(prefix="graphmem-ranks-")
        for rank in self.ranks:
            self._wait_below(self.at_once)
            path = os.path.join(self._folder, f"rank{rank}.pickle")
            parent = os.getpid()
            pid = os.fork()
            if pid == 0:
                after_fork(parent)
                self.rank, self._path, self._children, self._ended = rank, path, [], []
                progress.mute()  # one process speaks
                return rank
            self._children.append((pid, rank, path))
        self._wait_below(self.at_once)  # this process records its own rank now
        return None

    def _wait_below(self, count: int) -> None:
        """Wait until fewer than ``count`` children run."""
        while len(self._children) >= count:
            for child in list(self._children):
                pid, rank, path = child
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self._children.remove(child)
                    self._ended.append((rank, path, status))
            if len(self._children) >= count:
                interrupts.check()
                time.sleep(0.02)

    def send(self, result: Any) -> NoReturn:
        """In a child: hand ``result`` (a picklable value, or the exception that stopped it) back, and exit."""
        assert self.rank is not None, "RankFork.send: not a child"
        code = 0
        try:
            try:
                data = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # an exception that does not pickle: its message does
                if not isinstance(result, BaseException):
                    raise
                data = pickle.dumps(TraceError(f"recording rank {self.rank} failed: {result}"))
            with open(self._path + ".part", "wb") as f:
                f.write(data)
            os.replace(self._path + ".part", self._path)
        except BaseException:  # nothing may leave a forked child but its exit status
            code = 1
        os._exit(code)

    def gather(self) -> dict[int, Any]:
        """Wait for every child; what each sent, by rank (an exception a child sent is raised here)."""
        out: dict[int, Any] = {}
        try:
            self._wait_below(1)
            for rank, path, status in self._ended:
                if not os.path.exists(path):
                    raise TraceError(f"the process recording rank {rank} died (exit status {status}, out of "
                                     "memory?); run with GRAPHMEM_FORK_RANKS=0 to record each rank on its own")
                with open(path, "rb") as f:
                    out[rank] = pickle.load(f)
        finally:
            self.stop()
        for result in out.values():
            if isinstance(result, BaseException):
                raise result
        return out

    def stop(self) -> None:
        """End the children still running (after an error or Ctrl-C here), and remove their files."""
        for pid, _, _ in self._children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        self._children, self._ended = [], []
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = ""
