"""Worker and rank processes forked after the parent ran parallel ops do not deadlock.

torch on Linux builds its intra-op parallelism on GNU OpenMP, whose thread pool does not
survive a fork: a child forked after its parent ran a parallel region waited forever in its
first one (``graphmem plan`` on a Hugging Face preset hung every time).  Each check runs in a
fresh interpreter under a time limit, so a deadlock fails the test instead of hanging the suite;
the ops are large enough to run in parallel (past ATen's grain size), as a real plan's are.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

PARALLEL_OP = "torch.exp(torch.ones(4_000_000)).sum().item()"

FORK_MAP = f"""
import os, torch
from graphmem.process.workers import fork_map
assert torch.get_num_threads() > 1
{PARALLEL_OP}  # the parent's OpenMP pool is started
out = fork_map(lambda n: ({PARALLEL_OP}, torch.get_num_threads(), n)[1:], range(4), what="testing")
assert out == [(1, n) for n in range(4)], out
print("ok")
"""

RANK_FORK = f"""
import torch
from graphmem.trace.distributed.rank_fork import RankFork
{PARALLEL_OP}
fork = RankFork([1, 2, 3], at_once=2)
rank = fork.split()
if rank is not None:
    fork.send(({PARALLEL_OP}, rank)[1])
print(sorted(fork.gather().values()))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="OpenMP's fork hazard and the fix are Linux's")
@pytest.mark.parametrize("script, printed", [(FORK_MAP, "ok"), (RANK_FORK, "[1, 2, 3]")], ids=["fork_map", "ranks"])
def test_children_forked_after_parallel_ops_finish(script: str, printed: str) -> None:
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                              timeout=60, env={"GRAPHMEM_PROCESSES": "2", "PATH": "/usr/bin:/bin"})
        assert done.returncode == 0 and done.stdout.strip() == printed, done


def test_forked_children_run_autograd_after_a_recorded_step_or_the_calls_stay_here() -> None:
    """After a step was recorded in this process, fork_map's calls run autograd: in forked
    workers where a child can (a CPU build of torch), else here, one after another (a CUDA
    build refuses autograd in a child forked after it: forked_autograd_works asks a child)."""
    script = textwrap.dedent("""
        import os, torch, graphmem
        from graphmem.process.workers import fork_map, forked_autograd_works
        graphmem.analyze("tests/models.py:MLP", ["4x1000"], mode="train", optimizer="adam")
        def step(n):
            w = torch.ones(n, requires_grad=True)
            (w * 2).sum().backward()
            return (int(w.grad.sum()), os.getpid())
        results = fork_map(step, [1, 2, 3], what="a backward")
        assert [r[0] for r in results] == [2, 4, 6], results
        here = all(pid == os.getpid() for _, pid in results)
        assert here is not forked_autograd_works() or os.cpu_count() == 1, (results, forked_autograd_works())
        print("cuda" if torch.version.cuda else "cpu", "here" if here else "forked")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "GRAPHMEM_PROCESSES": "2"}, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


# a forked call that dies says how: each case in a fresh interpreter, under a time limit (a call
# whose helper process held the result pipe open waited as long as the helper lived: 30 s here)
DIES = """
import ctypes, os, signal, sys, time
import graphmem.process.workers as workers
from graphmem.errors import TraceError

def die(how):
    if how == "exit1":
        os._exit(1)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "segv":
        ctypes.string_at(0)
    if how == "helper":  # a helper that holds the pipe open for 30 s, then gone without a result
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 1)
            os.dup2(null, 2)
            time.sleep(30)
        os._exit(0)
    return how

how, runner = sys.argv[1], sys.argv[2]
try:
    if runner == "fork_once":
        kind, value, _ = workers.fork_once(lambda: die(how), what="testing")
        if kind == "raised":
            raise value
    elif runner == "fork_each":
        workers.fork_each(die, [how, "fine"], what="testing")
    else:
        workers.fork_map(die, [how, "fine"], what="testing")
except TraceError as exc:
    print(exc)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="fork, and the signals' names, as Linux has them")
@pytest.mark.parametrize("runner, how, said", [
    *((runner, how, said) for runner in ("fork_once", "fork_each", "fork_map")
      for how, said in (("exit1", "exited with status 1"), ("kill", "killed by SIGKILL (out of memory?)"),
                        ("segv", "killed by SIGSEGV"))),
    # a pool's worker outlives its calls: a helper holding its pipe changes nothing there
    ("fork_once", "helper", "exited with status 0"), ("fork_each", "helper", "exited with status 0"),
])
def test_a_forked_call_that_dies_says_how(runner: str, how: str, said: str) -> None:
    done = subprocess.run([sys.executable, "-c", DIES, how, runner], capture_output=True, text=True, timeout=20,
                          env={**os.environ, "GRAPHMEM_PROCESSES": "2"}, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    worker = "a worker process testing died: " if runner == "fork_map" else "a process testing died without a result: "
    assert done.stdout.strip() == worker + said + (
        "; run with GRAPHMEM_PROCESSES=1 to run them one after another" if runner == "fork_map" else ""), done
