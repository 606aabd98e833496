"""The timeline picture (matplotlib) and the CLI's picture options, from one analysis."""

from __future__ import annotations

import pickle
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import graphmem
import graphmem.cli.commands
from graphmem.cli import main
from graphmem.errors import UserInputError
from graphmem.memory.results import MemoryReport
from graphmem.report import write_timeline
from graphmem.report.timeline import MAX_POINTS, render_timeline, timeline_figure
from tests.conftest import ROOT

pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'graphmem[viz]')")

MLP = f"{ROOT}/examples/mlp.py:MLP"


@pytest.fixture(scope="module")
def mlp() -> MemoryReport:
    return graphmem.analyze(MLP, ["8x1000"], optimizer="adam")


def _svg_text(svg: bytes) -> str:
    root = ET.fromstring(svg)
    return " ".join(t for node in root.iter() for t in [node.text or ""] if t.strip())


def test_svg_names_the_peak_phases_and_categories(mlp: MemoryReport) -> None:
    mode = mlp.train
    assert mode is not None
    text = _svg_text(render_timeline(mode, "svg", "MLP train"))
    assert f"after op {mode.peak.step}" in text and mode.peak.op in text and mode.peak.module in text
    for label in ("backward 1", "optimizer 2", "parameters", "gradients", "optimizer_state", "forward phase"):
        assert label in text


def test_stacked_areas_reach_the_peak(mlp: MemoryReport) -> None:
    mode = mlp.train
    assert mode is not None
    fig = timeline_figure(mode, "MLP train", units="B")
    ax = fig.axes[0]
    tops = max(float(max(y for _, y in path.vertices)) for c in ax.collections for path in c.get_paths())
    assert tops == pytest.approx(mode.peak_bytes)  # units "B": the y axis is in bytes
    assert ax.get_ylabel() == "live bytes (B)"


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


def test_cli_writes_every_picture_from_one_analysis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pydot", reason="pydot is not installed (pip install 'graphmem[viz]')")
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


def test_inference_only_draws_inference(tmp_path: Path) -> None:
    report = graphmem.analyze(lambda: torch.nn.Linear(4, 3), ["2x4"], mode="inference")
    assert report.train is None and report.inference is not None
    from graphmem.report import write_files

    write_files(report, timeline=str(tmp_path / "t.svg"))
    assert "inference" in _svg_text((tmp_path / "t.svg").read_bytes())
