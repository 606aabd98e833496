"""graphmem.trace.repeat.graph: the fx graph of a recording placed by offset is the graph of
the whole recording, node for node, built by hand (tests/unit/trace/repeat/chains.py).  The
graphs are built and read, never run."""

from __future__ import annotations

import operator

import pytest
import torch

from graphmem.trace.repeat.place import repeat_blocks
from tests.unit.trace.repeat.chains import chain


def _args(node: torch.fx.Node) -> list[object]:
    """A node's arguments by name (a list of nodes as a list of names)."""
    return [[a.name for a in arg] if isinstance(arg, list) else arg.name if isinstance(arg, torch.fx.Node) else arg
            for arg in node.args]


def test_the_graph_is_built_when_first_asked_for() -> None:
    whole = repeat_blocks(chain(4), "layers", 6)
    left = whole.fx
    assert not isinstance(left, torch.fx.Graph)  # what builds it
    graph = whole.graph
    assert isinstance(graph, torch.fx.Graph) and whole.fx is graph  # built once, then kept


def test_an_inference_chain_of_six_blocks() -> None:
    graph = repeat_blocks(chain(4), "layers", 6).graph
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    assert placeholders == ["x"] + [f"layers_{b}_weight" for b in range(6)]  # the input, then w_0..w_5
    mms = [n for n in graph.nodes if n.op == "call_function"]
    assert [n.meta["graphmem"]["op_index"] for n in mms] == [0, 1, 2, 3, 4, 5]  # one mm per block, in order
    # block b multiplies block b - 1's product (x for block 0) by its own weight
    assert [_args(n) for n in mms] == [["x", "layers_0_weight"]] + [[mms[b - 1].name, f"layers_{b}_weight"]
                                                                   for b in range(1, 6)]


def test_a_training_step_with_an_optimizer_of_six_blocks() -> None:
    graph = repeat_blocks(chain(4, train=True, optimizer=True), "layers", 6).graph
    ops = [n for n in graph.nodes if "graphmem" in n.meta]
    assert [n.meta["graphmem"]["op_index"] for n in ops] == list(range(14))  # 6 mm, the loss, 6 backward, 1 foreach
    backward = ops[7:13]  # block 5's backward first: op 12 - b is block b's
    # each backward's two outputs are getitem 0 (d_b) and 1 (g_b)
    items = {(u.args[0], u.args[1]): u for u in graph.nodes if u.target is operator.getitem}
    assert len(items) == 12  # 6 backward ops, 2 outputs each
    # block 2's backward (op 10) reads h_1 (mm of block 1), w_2, and d_3 from block 3's backward (op 9)
    assert _args(ops[10]) == [ops[1].name, "layers_2_weight", items[(ops[9], 0)].name]
    assert _args(ops[7]) == [ops[4].name, "layers_5_weight", ops[6].name]  # block 5's: h_4, w_5, the loss
    weights = [f"layers_{b}_weight" for b in range(6)]
    # the _foreach_add_ takes w_0..w_5, then g_0..g_5: output 1 of block b's backward, op 12 - b
    assert _args(ops[13]) == [weights, [items[(backward[5 - b], 1)].name for b in range(6)]]


@pytest.mark.parametrize("length", [4, 5, 9])
@pytest.mark.parametrize("kind", [{}, {"train": True, "optimizer": True}], ids=["inference", "train_optimizer"])
def test_the_placed_graph_is_the_whole_recordings_graph(kind: dict[str, bool], length: int) -> None:
    placed = repeat_blocks(chain(4, **kind), "layers", length).graph
    assert str(placed) == str(chain(length, **kind).graph)  # the same nodes, names, targets and arguments
