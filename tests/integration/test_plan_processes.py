"""plan analyses its independent rows, and analyze the distinct ranks of a sharded step, in
worker processes when the machine has more than one core (graphmem.process.workers): the same plan and
the same report (graphs included) as one after another, and Ctrl-C stops the workers with the
command (exit 130)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest

from graphmem.api import analyze
from graphmem.job.job import make_job
from graphmem.preflight.budget import Budget
from graphmem.preflight.plan import make_plan
from graphmem.report.json import report_to_dict
from graphmem.trace.distributed.rank_fork import RankFork
from graphmem.trace.repeat.place import same_trace
from tests.conftest import ROOT
from tests.models import ZOO
from tests.optional import extended


@pytest.mark.parametrize("mode, name, spec", [
    pytest.param("train", "gpt", "4x16:int64",
                 marks=[pytest.mark.slow, extended("the inference plan in workers runs by default; a training "
                                                   "plan's rows are 40 s more")]),
    ("inference", "mlp", "8x1000")])
def test_worker_processes_make_the_same_plan(monkeypatch: pytest.MonkeyPatch, mode: str, name: str,
                                             spec: str) -> None:
    model = next(m for m in ZOO if m.name == name)
    job = make_job(model.build, (spec,), mode=mode, loss=model.loss, optimizer="adam")
    budget = Budget(1 << 20, Fraction(0), "1 MiB")
    plans = []
    for count in ("1", "2"):
        monkeypatch.setenv("GRAPHMEM_PROCESSES", count)
        plans.append(make_plan(job, budget, world_size=4))
    one, two = plans
    assert [(r.name, r.peak_bytes, r.fits, r.source, r.note) for r in one.rows] == \
        [(r.name, r.peak_bytes, r.fits, r.source, r.note) for r in two.rows]
    assert one.skipped == two.skipped and len(one.rows) > 3


def test_ranks_in_worker_processes_give_the_same_report(monkeypatch: pytest.MonkeyPatch) -> None:
    model = next(m for m in ZOO if m.name == "gpt")
    reports = []
    for count in ("1", "2"):
        monkeypatch.setenv("GRAPHMEM_PROCESSES", count)
        reports.append(analyze(model.build, ["4x16:int64"], mode="train", loss=model.loss, optimizer="adam",
                               parallel="fsdp=3"))  # FSDP2's ranks differ where a dim 0 does not split evenly
    one, two = reports
    assert one.train is not None and two.train is not None and len(one.train.ranks) > 1
    assert report_to_dict(one) == report_to_dict(two)
    # a rank recorded in a worker records its graph again here, when asked for
    assert str(one.train.trace.graph) == str(two.train.trace.graph)


ZERO_CASES = [dict(optimizer="adamw"), dict(optimizer="adam", optimizer_impl="foreach"),
              dict(optimizer="sgd", optimizer_kwargs={"momentum": 0.9}), dict(optimizer="adamw", grad_accum=2),
              dict(optimizer="adamw", device="cuda", gpu="h100-80gb")]


# AdamW (alone, with accumulation, on an H100) runs by default; Adam's foreach and SGD's momentum
# with GRAPHMEM_EXTENDED=1
_MORE = extended("AdamW alone, with accumulation and on an H100 runs by default")


@pytest.mark.parametrize("keywords, processes", [*((k, "2") if k["optimizer"] == "adamw" else
                                                   pytest.param(k, "2", marks=_MORE) for k in ZERO_CASES),
                                                 (ZERO_CASES[0], "1")],
                         ids=[*(",".join(f"{a}={b}" for a, b in k.items()) for k in ZERO_CASES), "one at a time"])
@pytest.mark.slow
def test_zero_ranks_from_one_beginning_are_each_ranks_own_recording(monkeypatch: pytest.MonkeyPatch,
                                                                    keywords: dict[str, object],
                                                                    processes: str) -> None:
    """ZeRO-1's ranks forked at the first optimizer step (graphmem.trace.distributed.rank_fork) record what
    each rank recorded from the start records: op for op, storage for storage, node for node;
    side by side, or (GRAPHMEM_PROCESSES=1) each child alone."""
    monkeypatch.setenv("GRAPHMEM_PROCESSES", processes)
    model = next(m for m in ZOO if m.name == "gpt")
    reports, splits = [], []
    split = RankFork.split
    monkeypatch.setattr(RankFork, "split", lambda self: splits.append(1) or split(self))
    for fork in ("0", "1"):
        monkeypatch.setenv("GRAPHMEM_FORK_RANKS", fork)
        reports.append(analyze(model.build, ["4x16:int64"], mode="train", loss=model.loss, parallel="zero1=4",
                               **keywords))
    alone, forked = (r.train for r in reports)
    assert alone is not None and forked is not None and len(forked.ranks) == len(alone.ranks) > 1
    for a, b in zip(alone.ranks, forked.ranks, strict=True):
        assert a.rank == b.rank and same_trace(a.report.trace, b.report.trace)
        assert str(a.report.trace.graph) == str(b.report.trace.graph)
        assert replace(a.report, trace=None, ranks=()) == replace(b.report, trace=None, ranks=())
    assert report_to_dict(reports[0]) == report_to_dict(reports[1])
    assert splits, "the ranks were not forked"


def _descendants(pid: int) -> set[int]:
    """The processes below ``pid``: graphmem's supervisor runs the command in a child, which
    starts the workers."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads child processes from /proc")
@pytest.mark.slow
def test_ctrl_c_stops_the_workers() -> None:
    env = {**os.environ, "GRAPHMEM_PROCESSES": "2"}
    process = subprocess.Popen([sys.executable, "-m", "graphmem", "plan", "examples/gpt.py:GPT", "--input",
                                "8x256:int64", "--loss", "cross_entropy", "--budget", "1MiB"],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: set[int] = set()
    deadline = time.monotonic() + 120
    while len(workers) < 3 and process.poll() is None and time.monotonic() < deadline:
        workers |= _descendants(process.pid)  # the command's process and its two workers
        time.sleep(0.05)
    assert len(workers) >= 3, "the plan never started its worker processes"
    time.sleep(0.5)  # they are recording
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, (out, err)
    assert "interrupted" in err and "Traceback" not in err, err
    time.sleep(0.5)
    alive = set()
    for pid in workers:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    assert not alive, f"worker processes still running after the command ended: {alive}"
