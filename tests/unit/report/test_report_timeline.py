"""The timeline picture (matplotlib) and the CLI's picture options, from one analysis."""

from __future__ import annotations

import io
import math
import pickle
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import graphmem
import graphmem.cli.commands
from graphmem.cli import main
from graphmem.errors import UserInputError
from graphmem.memory.liveness import compute_lifetimes
from graphmem.memory.mode_report import build_mode_report
from graphmem.memory.results import MemoryReport, ModeReport
from graphmem.records import OpRecord, Phase, Role, StorageRecord, Trace
from graphmem.report import write_timeline
from graphmem.report.series import column_peaks
from graphmem.report.timeline import COLOURS, DPI, MAX_POINTS, render_timeline, timeline_figure
from tests.conftest import ROOT
from tests.optional import needs

MLP = f"{ROOT}/examples/mlp.py:MLP"


@pytest.fixture(scope="module")
def mlp() -> MemoryReport:
    return graphmem.analyze(MLP, ["8x1000"], optimizer="adam")


def _svg_text(svg: bytes) -> str:
    root = ET.fromstring(svg)
    return " ".join(t for node in root.iter() for t in [node.text or ""] if t.strip())


@needs("matplotlib")
def test_svg_names_the_peak_phases_and_categories(mlp: MemoryReport) -> None:
    mode = mlp.train
    assert mode is not None
    text = _svg_text(render_timeline(mode, "svg", "MLP train"))
    assert f"after op {mode.peak.step}" in text and mode.peak.op_name in text and mode.peak.module in text
    assert mode.peak.op not in text  # "relu", not "aten.relu.default"
    for label in ("backward 1", "optimizer 2", "parameters", "gradients", "optimizer_state", "forward phase"):
        assert label in text


@needs("matplotlib")
def test_stacked_areas_reach_the_peak(mlp: MemoryReport) -> None:
    mode = mlp.train
    assert mode is not None
    fig = timeline_figure(mode, "MLP train", units="B")
    ax = fig.axes[0]
    tops = max(float(max(y for _, y in path.vertices)) for c in ax.collections for path in c.get_paths())
    assert tops == pytest.approx(mode.peak_bytes)  # units "B": the y axis is in bytes
    assert ax.get_ylabel() == "live bytes (B)"


@needs("matplotlib")
def test_png_and_html(mlp: MemoryReport, tmp_path: Path) -> None:
    assert mlp.train is not None
    write_timeline(mlp.train, tmp_path / "t.png", "MLP")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    write_timeline(mlp.train, tmp_path / "t.html", "MLP")
    html = (tmp_path / "t.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html and f"after op {mlp.train.peak.step}" in html


def test_many_ops_are_downsampled(mlp: MemoryReport) -> None:
    from graphmem.report.series import bucket_peaks

    assert len(bucket_peaks(list(range(40_000)), MAX_POINTS)) == MAX_POINTS


def test_missing_matplotlib_names_the_extra(mlp: MemoryReport, monkeypatch: pytest.MonkeyPatch) -> None:
    assert mlp.train is not None
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UserInputError, match=r"pip install 'graphmem\[viz\]'"):
        render_timeline(mlp.train, "svg", "x")


@needs("matplotlib", "pydot")
def test_cli_writes_every_picture_from_one_analysis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = graphmem.cli.commands.analyze

    def counted(*args: object, **kwargs: object) -> object:
        calls.append("analyze")
        return real(*args, **kwargs)

    monkeypatch.setattr(graphmem.cli.commands, "analyze", counted)
    result = CliRunner().invoke(main, ["analyze", MLP, "-i", "4x1000", "--timeline", str(tmp_path / "t.svg"),
                                       "--snapshot", str(tmp_path / "s.pickle"), "--dot", str(tmp_path / "g.dot"),
                                       "--depth", "1", "--top", "2"])
    assert result.exit_code == 0, result.output
    assert calls == ["analyze"]
    assert "Per module, train (adam), depth 1" in result.output and "Top 2 tensors" in result.output
    data = pickle.loads((tmp_path / "s.pickle").read_bytes())
    assert data["device_traces"][0][0]["action"] == "alloc"
    assert (tmp_path / "g.dot").read_text().startswith("strict digraph")
    assert b"<svg" in (tmp_path / "t.svg").read_bytes()


@pytest.mark.parametrize("option, path, fragment", [
    ("--timeline", "t.jpg", "expected a file ending in .svg, .png, .html"),
    ("--snapshot", "s.json", "expected a file ending in .pickle"),
    ("--dot", "g.txt", "expected a file ending in .dot, .gv, .svg, .png, .pdf"),
])
def test_cli_refuses_a_bad_picture_path_before_analysing(tmp_path: Path, option: str, path: str,
                                                         fragment: str) -> None:
    result = CliRunner().invoke(main, ["analyze", MLP, "-i", "4x1000", option, str(tmp_path / path)])
    assert result.exit_code == 2
    assert fragment in result.output and "Traceback" not in result.output


@needs("matplotlib")
def test_inference_only_draws_inference(tmp_path: Path) -> None:
    report = graphmem.analyze(lambda: torch.nn.Linear(4, 3), ["2x4"], mode="inference")
    assert report.train is None and report.inference is not None
    from graphmem.report import write_files

    write_files(report, timeline=str(tmp_path / "t.svg"))
    assert "inference" in _svg_text((tmp_path / "t.svg").read_bytes())


MIB = 2**20


def _spike_mode(num_ops: int = 60_000, spike: int = 41_234) -> ModeReport:
    """A long made-up step: a 64 MiB parameter, a 1 MiB activation made every 1,000 ops of the
    forward and freed in the mirrored op of the backward, and one 40 MiB temporary live after
    op ``spike`` only (a foreach kernel's output, one op wide in 60,000)."""
    half = num_ops // 2
    storages = [StorageRecord(0, 64 * MIB, -1, None, frozenset({Role.PARAMETER}), "w", (16 * MIB,), "float32")]
    for k, made in enumerate(range(0, half, 1000), start=1):
        storages.append(StorageRecord(k, MIB, made, num_ops - 1 - made, frozenset({Role.SAVED}), "", (MIB // 4,),
                                      "float32"))
    storages.append(StorageRecord(len(storages), 40 * MIB, spike, spike, frozenset(), "", (10 * MIB,), "float32"))
    made_at = {s.created: (s.sid,) for s in storages if s.created >= 0}
    ops = tuple(OpRecord(index=i, op="aten.relu.default", phase=Phase.FORWARD if i < half else Phase.BACKWARD,
                         iteration=0, module="layer", inputs=(0,), outputs=made_at.get(i, ()), scratch_bytes=0)
                for i in range(num_ops))
    trace = Trace(mode="train", fx=torch.fx.Graph(), ops=ops, storages=tuple(storages), optimizer=None)
    return build_mode_report(trace, compute_lifetimes(trace))


def _stack_tops(png: bytes, box: Any) -> dict[int, int]:
    """Per pixel column of the plot ``box`` (display pixels), the top row (0 at the top of the
    PNG) of the area painted in the categories' colours without a gap up from the x axis: the
    drawn stack, not text or markers."""
    from matplotlib.colors import to_rgb
    from matplotlib.image import imread

    pixels = imread(io.BytesIO(png), format="png")[:, :, :3]
    height = pixels.shape[0]
    painted = (pixels < -1).all(axis=2)
    for colour in COLOURS.values():
        painted |= (abs(pixels - to_rgb(colour)) < 1.5 / 255).all(axis=2)
    tops = {}
    for x in range(math.ceil(box.x0), math.floor(box.x1)):
        row = height - math.ceil(box.y0) - 1  # the lowest row inside the plot
        while row > height - box.y1 and painted[row - 1, x]:
            row -= 1
        if painted[row, x]:
            tops[x] = row
    return tops


@needs("matplotlib")
def test_png_draws_a_one_op_spike_up_to_the_peak_marker() -> None:
    mode = _spike_mode()
    # by hand: the parameter, the activations still live after op 41,234 (made at m, freed after
    # 59,999 - m >= 41,234: m = 0, 1,000, ..., 18,000, 19 of them) and the spike
    assert mode.peak_bytes == 64 * MIB + 19 * MIB + 40 * MIB and mode.peak.step == 41_234
    png = render_timeline(mode, "png", "spike", units="MiB")
    fig = timeline_figure(mode, "spike", units="MiB")  # the same figure, laid out as the PNG was
    fig.draw_without_rendering()
    ax = fig.axes[0]
    height = round(fig.get_figheight() * DPI)
    peak_x, peak_y = ax.transData.transform((mode.peak.step, mode.peak_bytes / MIB))
    around = ax.transData.transform((mode.peak.step, (mode.peak_bytes - 40 * MIB) / MIB))[1]
    tops = _stack_tops(png, ax.get_window_extent())
    highest = min(tops, key=tops.__getitem__)
    # the highest painted pixel column is the peak's, and it reaches the marker's height
    assert abs(highest - peak_x) <= 1.5, (highest, peak_x)
    assert abs(tops[highest] - (height - peak_y)) <= 1.0, (tops[highest], height - peak_y)
    # beside the spike the stack stays at the bytes without it
    assert abs(tops[highest + 5] - (height - around)) <= 1.0


def test_column_peaks_keep_the_highest_op_of_each_column() -> None:
    values = [0] * 10_000
    values[4_321] = 7
    columns = column_peaks(values, 1000)
    assert len(columns) == 1000 and columns[0].start == -0.5 and columns[-1].end == 10_000 - 0.5
    assert [c.op for c in columns if values[c.op] == 7] == [4_321]  # ops 4320..4329 form column 432
    # an op across a column edge counts in both columns it covers
    assert [c.op for c in column_peaks([1, 5, 1], 2)] == [1, 1]
    assert [c.op for c in column_peaks([3, 1], 5)] == [0, 1]  # fewer ops than columns: one op each
