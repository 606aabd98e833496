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
from graphmem.workers import fork_map
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
        from graphmem.workers import fork_map, forked_autograd_works
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
