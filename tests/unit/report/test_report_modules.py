"""Per-module table, top tensors, sparkline and the series behind the pictures.

Expected bytes are derived by hand (float32: 4 bytes an element) on a small nested model,
or from the real torch modules' own parameters; never from graphmem's helpers.
"""

from __future__ import annotations

import json

import pytest

import graphmem
from graphmem.memory.results import MemoryReport
from graphmem.records import OpRecord, Phase
from graphmem.report import RENDERERS, module_rows, top_tensors
from graphmem.report.series import bucket_peaks, category_timelines, phase_spans
from graphmem.report.sparkline import BLOCKS, render_sparkline, sparkline
from tests.models import NestedNet as Net


@pytest.fixture(scope="module")
def report() -> MemoryReport:
    return graphmem.analyze(Net, ["2x4"], optimizer="adam", loss="sum")


def _by_module(rows: tuple[object, ...], field: str) -> dict[str, int]:
    return {r.module: getattr(r, field) for r in rows if getattr(r, field)}  # type: ignore[attr-defined]


def test_module_rows_by_hand(report: MemoryReport) -> None:
    assert report.train is not None
    rows = module_rows(report.train, depth=3)
    # Linear(4,4): weight 16 + bias 4 elements = 80 B; Linear(4,2): 8 + 2 = 40 B
    assert _by_module(rows, "params_bytes") == {"blocks.0.fc": 80, "blocks.1.fc": 80, "head": 40}
    assert _by_module(rows, "grads_bytes") == {"blocks.0.fc": 80, "blocks.1.fc": 80, "head": 40}
    # Adam: exp_avg + exp_avg_sq the size of each parameter, plus a float32 `step` per parameter
    # (6 of them), all made by the optimizer step and charged to it, not to the modules
    assert _by_module(rows, "optimizer_state_bytes") == {"(optimizer step)": 2 * (80 + 80 + 40) + 6 * 4}
    # saved for backward and not a parameter or input: each ReLU's 2x4 output, 32 B
    assert _by_module(rows, "activations_bytes") == {"blocks.0.act": 32, "blocks.1.act": 32}


@pytest.mark.parametrize("depth, names", [
    (1, {"blocks": 160, "head": 40}),
    (2, {"blocks.0": 80, "blocks.1": 80, "head": 40}),
])
def test_depth_folds_children_into_their_ancestor(report: MemoryReport, depth: int, names: dict[str, int]) -> None:
    assert report.inference is not None
    assert _by_module(module_rows(report.inference, depth), "params_bytes") == names


@pytest.mark.parametrize("mode_name", ["inference", "train"])
def test_columns_sum_to_the_totals(report: MemoryReport, mode_name: str) -> None:
    mode = getattr(report, mode_name)
    for depth in (1, 2, 3):
        rows = module_rows(mode, depth)
        assert sum(r.params_bytes for r in rows) == mode.params_bytes == 200
        assert sum(r.grads_bytes for r in rows) == mode.grads_bytes
        assert sum(r.optimizer_state_bytes for r in rows) == mode.optimizer_state_bytes
        assert sum(r.activations_bytes for r in rows) == mode.activations_bytes
        assert sum(r.peak_bytes for r in rows) == mode.peak_bytes
        assert next(r.module for r in rows) == "(inputs)"


def test_top_tensors_are_the_largest_live_at_the_peak(report: MemoryReport) -> None:
    mode = report.train
    assert mode is not None
    step = mode.peak.step
    # live after the peak op, from the raw storage records: created at or before, released at or after
    live = sorted((s.nbytes for s in mode.trace.storages
                   if s.created <= step and (s.released is None or s.released >= step)), reverse=True)
    tops = top_tensors(mode, 5)
    assert [t.nbytes for t in tops] == live[:5]
    assert sum(t.nbytes for t in top_tensors(mode, 10_000)) == mode.peak_bytes
    first = tops[0]
    assert first.shape == (4, 4) and first.dtype == "float32" and first.nbytes == 64
    assert all(t.created == -1 or t.op.startswith("aten.") for t in tops)


def test_table_has_the_sections_and_options(report: MemoryReport) -> None:
    text = RENDERERS["table"](report, "B", depth=1, top=3)
    assert "Per module, train (adam), depth 1" in text
    assert "Top 3 tensors live at the peak" in text
    section = text.split("Per module")[1].split("Top 3")[0]
    assert "blocks " in section and "blocks.0" not in section
    total = next(line for line in section.splitlines() if line.startswith("total"))
    assert "200 B" in total  # parameters
    assert any(ch in text for ch in BLOCKS) and "^ peak" in text
    assert "Top" not in RENDERERS["table"](report, "B", depth=1, top=0)


def test_json_has_modules_and_top_tensors(report: MemoryReport) -> None:
    data = json.loads(RENDERERS["json"](report, "auto", depth=2, top=4))
    train = data["train"]
    assert train["module_depth"] == 2
    assert sum(m["peak_bytes"] for m in train["modules"]) == train["peak_bytes"]
    assert sum(m["params_bytes"] for m in train["modules"]) == train["params_bytes"] == 200
    assert len(train["top_tensors"]) == 4
    assert {"nbytes", "shape", "dtype", "category", "name", "op", "module", "dies"} <= set(train["top_tensors"][0])
    assert "modules" in data["inference"]


def test_category_timelines_sum_to_the_timeline(report: MemoryReport) -> None:
    for mode in (report.inference, report.train):
        assert mode is not None
        series = category_timelines(mode)
        assert tuple(map(sum, zip(*series.values()))) == mode.timeline
        assert all(v >= 0 for values in series.values() for v in values)


def _op(i: int, phase: Phase, iteration: int) -> OpRecord:
    return OpRecord(index=i, op="aten.x", phase=phase, iteration=iteration, module="",
                    inputs=(), outputs=(), scratch_bytes=0)


def test_phase_spans_split_by_phase_and_iteration() -> None:
    phases = [(Phase.FORWARD, 0)] * 2 + [(Phase.LOSS, 0), (Phase.BACKWARD, 0), (Phase.FORWARD, 1)]
    spans = phase_spans([_op(i, p, it) for i, (p, it) in enumerate(phases)])
    assert [(s.phase, s.iteration, s.start, s.end) for s in spans] == [
        ("forward", 0, 0, 1), ("loss", 0, 2, 2), ("backward", 0, 3, 3), ("forward", 1, 4, 4)]


def test_bucket_peaks_keeps_every_bucket_maximum() -> None:
    values = [i % 97 for i in range(50_000)] + [10_000] + [1] * 49_999
    picks = bucket_peaks(values, 3000)
    assert len(picks) == 3000 and list(picks) == sorted(picks)
    assert 50_000 in picks  # the global peak survives
    assert bucket_peaks([3, 1, 2], 10) == (0, 1, 2)


def test_sparkline_scale_and_peak_caret(report: MemoryReport) -> None:
    assert sparkline([0, 7, 14], 0, 14) == BLOCKS[0] + BLOCKS[4] + BLOCKS[7]  # 7/14 of 7 levels rounds to 4
    assert report.train is not None
    _header, line, phases, caret = render_sparkline(report.train, "B", width=40).splitlines()
    assert len(line) == len(phases) == 40
    assert line[caret.index("^")] == BLOCKS[-1]
    assert set(phases) <= set("flboFLBO") and "F" in phases
