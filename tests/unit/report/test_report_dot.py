"""DOT graphs: written, parsed back (pydot via networkx), node counts and the peak set
checked by hand; rendered by Graphviz when its `dot` program is installed."""

from __future__ import annotations

import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import networkx as nx
import pytest
import torch
from torch import nn

import graphmem
from graphmem.errors import UserInputError
from graphmem.memory.results import MemoryReport, ModeReport
from graphmem.report import write_dot
from graphmem.report.dot import AUTO_COLLAPSE_NODES, to_dot
from tests.conftest import ROOT
from tests.models import NestedNet as Net
from tests.optional import installed, needs

# pydot's parser still calls pyparsing's old names
pytestmark = pytest.mark.filterwarnings("ignore:'.*' deprecated - use:DeprecationWarning")


def _unquote(value: object) -> str:
    return str(value).strip('"')


def _constants(graph: torch.fx.Graph) -> int:
    """Tensors an op read that no recorded op or placeholder made (fx get_attr nodes)."""
    return sum(1 for node in graph.nodes if node.op == "get_attr")


def read_back(path: Path) -> nx.MultiDiGraph:
    return nx.nx_pydot.read_dot(str(path))


@pytest.fixture(scope="module")
def linear() -> MemoryReport:
    return graphmem.analyze(lambda: nn.Linear(4, 3), ["2x4"], optimizer="sgd", loss="sum")


@pytest.fixture
def op_graph(linear: MemoryReport, tmp_path: Path) -> tuple[ModeReport, nx.MultiDiGraph]:
    """The training step and its op-level DOT graph, written and parsed back (skipped without pydot)."""
    installed("pydot")
    mode = linear.train
    assert mode is not None
    write_dot(mode, tmp_path / "g.dot", collapse="op")
    return mode, read_back(tmp_path / "g.dot")


def test_op_graph_parses_with_every_op_and_the_peak_set(op_graph: tuple[ModeReport, nx.MultiDiGraph]) -> None:
    mode, graph = op_graph
    # one node per recorded op, plus the placeholders weight, bias and input 0 (and any constant)
    assert graph.number_of_nodes() == len(mode.trace.ops) + 3 + _constants(mode.trace.graph)
    assert {"in_weight", "in_bias", "in_input_0"} <= set(graph.nodes)
    marked = {n for n, attrs in graph.nodes(data=True) if "peak" in _unquote(attrs.get("class", "")).split()}
    # the storages live after the peak op, from the raw records, and the node that made each
    step = mode.peak.step
    live = [s for s in mode.trace.storages if s.created <= step and (s.released is None or s.released >= step)]
    makers = {f"op{s.created}" if s.created >= 0 else "in_" + s.label.replace(" ", "_") for s in live}
    assert marked == makers | {f"op{step}"}
    assert {"in_weight", "in_bias", "in_input_0"} <= marked  # parameters and input are live throughout
    assert sum(s.nbytes for s in live) == 184  # see test_report_snapshot: 184 B by hand
    peak = graph.nodes[f"op{step}"]
    assert _unquote(peak["shape"]) == "doubleoctagon" and "PEAK" in _unquote(peak["label"])


def test_saved_for_backward_edges_are_dashed(op_graph: tuple[ModeReport, nx.MultiDiGraph]) -> None:
    mode, graph = op_graph
    dashed = {(u, v) for u, v, attrs in graph.edges(data=True) if _unquote(attrs.get("style", "")) == "dashed"}
    # Linear saves only its input (for the weight gradient, mm in backward); both iterations
    mms = {f"op{o.index}" for o in mode.trace.ops if o.op == "aten.mm.default" and o.phase == "backward"}
    assert len(mms) == 2
    assert dashed == {("in_input_0", mm) for mm in mms}
    solid = [(u, v) for u, v, attrs in graph.edges(data=True) if "style" not in attrs]
    assert ("in_weight", "op0") in solid and ("op0", "op1") in solid  # t(weight) -> addmm




@needs("pydot")
@pytest.mark.parametrize("depth, nodes", [
    (1, {"(inputs)", "blocks", "head"}),
    (2, {"(inputs)", "blocks.0", "blocks.1", "head"}),
    (3, {"(inputs)", "blocks.0.fc", "blocks.0.act", "blocks.1.fc", "blocks.1.act", "head"}),
])
def test_module_collapse_follows_the_module_tree(tmp_path: Path, depth: int, nodes: set[str]) -> None:
    report = graphmem.analyze(Net, ["2x4"], mode="inference")
    assert report.inference is not None
    write_dot(report.inference, tmp_path / "m.dot", collapse="module", depth=depth)
    graph = read_back(tmp_path / "m.dot")
    assert {_unquote(n) for n in graph.nodes} == nodes
    peak_module = [n for n, a in graph.nodes(data=True) if "peak_op" in _unquote(a.get("class", ""))]
    assert len(peak_module) == 1
    # data flows blocks.0 -> blocks.1 -> head
    if depth == 2:
        edges = {(_unquote(u), _unquote(v)) for u, v in graph.edges()}
        assert {("blocks.0", "blocks.1"), ("blocks.1", "head"), ("(inputs)", "blocks.0")} <= edges


@needs("pydot")
def test_auto_collapses_large_graphs(linear: MemoryReport, tmp_path: Path) -> None:
    assert linear.train is not None
    small = write_dot(linear.train, tmp_path / "a.dot")
    # op level: under the limit
    assert small.number_of_nodes() == len(linear.train.trace.ops) + 3 + _constants(linear.train.trace.graph)
    big = graphmem.analyze(f"{ROOT}/examples/gpt.py:GPT", ["1x8:int64"], mode="train", optimizer="sgd",
                           kwargs={"vocab": 50, "dim": 16, "layers": 2, "heads": 2, "max_seq": 8})
    assert big.train is not None and big.train.num_ops > AUTO_COLLAPSE_NODES
    graph = write_dot(big.train, tmp_path / "b.dot", depth=2)
    assert set(graph.nodes) >= {"blocks.0", "blocks.1", "tok", "pos", "ln_f"}
    assert graph.number_of_nodes() < 15


@needs("pydot")
@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's `dot` program is not installed")
def test_graphviz_renders_svg_with_the_peak_class(linear: MemoryReport, tmp_path: Path) -> None:
    assert linear.train is not None
    write_dot(linear.train, tmp_path / "g.svg", collapse="op")
    root = ET.fromstring((tmp_path / "g.svg").read_text())
    classes = [g.get("class", "") for g in root.iter("{http://www.w3.org/2000/svg}g")]
    expected = len(linear.train.trace.ops) + 3 + _constants(linear.train.trace.graph)
    assert sum("node" in c.split() for c in classes) == expected
    assert any("peak_op" in c.split() for c in classes)


def test_missing_pydot_names_the_extra(linear: MemoryReport, monkeypatch: pytest.MonkeyPatch) -> None:
    assert linear.train is not None
    monkeypatch.setitem(sys.modules, "pydot", None)
    with pytest.raises(UserInputError, match=r"graphmem\[viz\]"):
        to_dot(nx.DiGraph())


def test_unknown_suffix_is_a_user_error(linear: MemoryReport, tmp_path: Path) -> None:
    assert linear.train is not None
    with pytest.raises(UserInputError, match=r"\.dot, \.gv, \.svg"):
        write_dot(linear.train, tmp_path / "g.jpeg")
