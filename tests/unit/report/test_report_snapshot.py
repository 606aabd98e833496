"""The memory_viz snapshot: PyTorch's own torch.cuda._memory_viz reads it, and its events
replay to the peak derived by hand."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.cuda import _memory_viz

import graphmem
from graphmem.memory.liveness import compute_lifetimes
from graphmem.memory.mode_report import build_mode_report
from graphmem.memory.results import MemoryReport
from graphmem.records import OpRecord, Phase, Role, StorageRecord, Trace
from graphmem.report import build_snapshot, write_snapshot


@pytest.fixture(scope="module")
def linear() -> MemoryReport:
    return graphmem.analyze(lambda: torch.nn.Linear(4, 3), ["2x4"], optimizer="sgd", loss="sum")


def replay(data: dict[str, Any]) -> tuple[int, int]:
    """(peak, bytes still live) from the trace entries, as the viewer's timeline adds them up."""
    live = peak = 0
    for entry in data["device_traces"][0]:
        if entry["action"] == "alloc":
            live += entry["size"]
            peak = max(peak, live)
        elif entry["action"] == "free_completed":
            live -= entry["size"]
    return peak, live


def test_replay_peak_by_hand(linear: MemoryReport, tmp_path: Path) -> None:
    assert linear.train is not None
    path = tmp_path / "snap.pickle"
    write_snapshot(linear.train, path, "Linear")
    data = pickle.loads(path.read_bytes())
    # after the bias-gradient sum in backward: weight 48 + bias 12 + input 32 + output 24 + loss 4
    # + grad seed 4 + weight.grad 48 + bias.grad 12 = 184 B
    peak, left = replay(data)
    assert peak == 184 == linear.train.peak_bytes
    # still live after the step: weight, bias, input (the grads died at zero_grad): 48 + 12 + 32
    assert left == 92 == data["segments"][0]["allocated_size"]


def test_pytorch_memory_viz_reads_it(linear: MemoryReport) -> None:
    assert linear.train is not None
    data = build_snapshot(linear.train, "Linear")
    summary = _memory_viz.segsum(data)  # raises on blocks that do not add up to the segment
    assert "segments: 1" in summary
    assert _memory_viz.trace(data).startswith("Device 0")
    html = _memory_viz.trace_plot(pickle.loads(pickle.dumps(data)))
    assert "snapshot.pickle" in html and "Active Memory Timeline" in html
    assert "Allocator State History" in _memory_viz.segment_plot(data)


def test_entries_and_blocks_are_consistent(linear: MemoryReport) -> None:
    assert linear.train is not None
    data = build_snapshot(linear.train, "Linear")
    entries = data["device_traces"][0]
    allocs = [e for e in entries if e["action"] == "alloc"]
    assert len(allocs) == len(linear.train.trace.storages) and len({e["addr"] for e in allocs}) == len(allocs)
    freed = [e["addr"] for e in entries if e["action"] == "free_completed"]
    assert freed == [e["addr"] for e in entries if e["action"] == "free_requested"]
    segment = data["segments"][0]
    assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
    # the viewer adds active blocks not allocated in the trace: there must be none of those
    active = [b for b in segment["blocks"] if b["state"] == "active_allocated"]
    offsets = [segment["address"] + sum(b["size"] for b in segment["blocks"][:i])
               for i, b in enumerate(segment["blocks"]) if b["state"] == "active_allocated"]
    assert set(offsets) == {e["addr"] for e in allocs} - set(freed) and len(active) == 3
    # MemoryViz.js fails on a "category" set without "unknown" (annotate_snapshot's typo)
    assert all("category" not in e for e in entries)


def test_frames_name_the_op_module_and_phase() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    report = graphmem.analyze(net, ["2x4"], mode="inference")
    assert report.inference is not None
    entries = build_snapshot(report.inference, "Seq")["device_traces"][0]
    stacks = [_memory_viz._frames_fmt(e["frames"]) for e in entries if e["action"] == "alloc"]
    assert ["parameters:0:0.weight", "module:0:Seq.0", "module:0:Seq", "inference step:0:before the step"] in stacks
    relu = next(s for s in stacks if "aten.relu.default" in s[0])
    assert relu[1:] == ["module:0:Seq.1", "module:0:Seq", "inference step:1:forward (iteration 1)"]
    assert relu[0].startswith("outputs:")


def _hand_trace() -> Trace:
    op = lambda i, phase, scratch=0: OpRecord(index=i, op=f"aten.op{i}", phase=phase,
                                              iteration=0, module="m", inputs=(), outputs=(), scratch_bytes=scratch)
    store = lambda sid, n, c, r, *roles: StorageRecord(sid=sid, nbytes=n, created=c, released=r,
                                                       roles=frozenset(roles), label="", shape=(), dtype="float32")
    return Trace(mode="train", fx=torch.fx.Graph(),
                 ops=(op(0, Phase.FORWARD), op(1, Phase.FORWARD, scratch=5), op(2, Phase.BACKWARD, scratch=3)),
                 storages=(store(0, 100, -1, None, Role.PARAMETER), store(1, 10, 0, 2), store(2, 7, 1, 1)),
                 optimizer="sgd")


def test_scratch_bytes_are_allocated_with_their_op() -> None:
    trace = _hand_trace()
    mode = build_mode_report(trace, compute_lifetimes(trace))
    data = build_snapshot(mode)
    # after op 1: parameter 100 + storage 1 (10) + storage 2 (7) + op 1's scratch 5 = 122;
    # storage 1 is released after the last op, so only the parameter is left
    assert replay(data) == (122, 100)
    sizes = [(e["action"], e["size"]) for e in data["device_traces"][0] if e["action"] != "free_requested"]
    assert sizes == [("alloc", 100), ("alloc", 10), ("alloc", 7), ("alloc", 5), ("free_completed", 5),
                     ("free_completed", 7), ("alloc", 3), ("free_completed", 3), ("free_completed", 10)]
