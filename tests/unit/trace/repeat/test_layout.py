"""graphmem.trace.repeat.layout on hand-built cut recordings (tests/unit/trace/repeat/chains.py):
which block each op and storage is, each block's runs of ops and their order.  No torch runs."""

from __future__ import annotations

import pytest
import torch

from graphmem.records import OpRecord, Phase, Role, StorageRecord, Trace
from graphmem.trace.repeat.layout import Stacked, Unrepeatable, layout
from graphmem.trace.repeat.place import repeat_blocks
from tests.unit.trace.repeat.chains import chain

WEIGHT_0 = ("n", "layers.0.weight", 0)  # a weight's id within its block: its name as in block 0, first of it


def test_an_inference_chain_is_one_run_per_block() -> None:
    lay = layout(chain(4), Stacked("layers"))
    # op b runs in module layers.b: block b, its run 0, position 0 in the run
    assert lay.kind == ((0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0))
    assert lay.runs == (((0, 1),), ((1, 2),), ((2, 3),), ((3, 4),))  # op b alone: (b, b + 1)
    assert lay.ascending == (True,)  # block 2's run starts where block 1's stops (2)
    # weights w_b = sid 1 + b by their name; h_b = sid 5 + b as output 0 of op 0 of run 0; x (sid 0) is no block's
    assert lay.owner == {1: (0, WEIGHT_0), 2: (1, WEIGHT_0), 3: (2, WEIGHT_0), 4: (3, WEIGHT_0),
                         5: (0, ("o", 0, 0, 0)), 6: (1, ("o", 0, 0, 0)), 7: (2, ("o", 0, 0, 0)), 8: (3, ("o", 0, 0, 0))}
    assert lay.local[1] == {WEIGHT_0: 2, ("o", 0, 0, 0): 6}  # block 1's w_1 (sid 2) and h_1 (sid 6)
    assert lay.ends == frozenset({3})  # one phase, ending at the last op


def test_a_training_chain_runs_its_backward_in_descending_order() -> None:
    lay = layout(chain(4, train=True, optimizer=True), Stacked("layers"))
    # forward ops 0-3 are blocks 0-3 (run 0); the loss (op 4) is outside; the backward op of
    # block b is op 8 - b (run 1); the optimizer's _foreach_add_ (op 9) takes every block: shared
    assert lay.kind == ((0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 0, 0), None,
                        (3, 1, 0), (2, 1, 0), (1, 1, 0), (0, 1, 0), "shared")
    assert lay.runs == (((0, 1), (8, 9)), ((1, 2), (7, 8)), ((2, 3), (6, 7)), ((3, 4), (5, 6)))
    # run 0: block 2 starts at 2, where block 1 stops; run 1: block 1 starts at 7, where block 2 stops
    assert lay.ascending == (True, False)
    # the backward op of block b makes d_b (output 0) and g_b (output 1): sids 16 - 2b and 17 - 2b
    assert lay.owner[10] == (3, ("o", 1, 0, 0)) and lay.owner[11] == (3, ("o", 1, 0, 1))
    assert lay.owner[16] == (0, ("o", 1, 0, 0)) and lay.owner[17] == (0, ("o", 1, 0, 1))
    assert 9 not in lay.owner  # the loss, made outside the stack
    assert lay.ends == frozenset({3, 4, 8, 9})  # the last op of forward, loss, backward, optimizer


def _drawn(n: int, before: tuple[int, ...] = (1, 2, 3), phase: Phase = Phase.FORWARD) -> Trace:
    """``n`` blocks, the blocks in ``before`` preceded by a draw outside any module (as LayerDrop
    draws before each layer) in ``phase``: ops mm_0, draw_1, mm_1, ..., draw_{n-1}, mm_{n-1}.
    Storages: x = 0, w_b = 1 + b, then in the order made: draw_b's number r_b (freed at once)
    before h_b."""
    ops: list[OpRecord] = []
    storages = [StorageRecord(0, 64, -1, None, frozenset({Role.INPUT}), "x", (2, 8), "float32")]
    storages += [StorageRecord(1 + b, 256, -1, None, frozenset({Role.PARAMETER}), f"layers.{b}.weight", (8, 8),
                               "float32") for b in range(n)]
    sid, h = 1 + n, 0
    for b in range(n):
        if b in before:
            ops.append(OpRecord(len(ops), "aten.rand.default", phase, 0, "", (), (sid,), 0))
            storages.append(StorageRecord(sid, 4, len(ops) - 1, len(ops) - 1, frozenset(), "", (), "float32"))
            sid += 1
        ops.append(OpRecord(len(ops), "aten.mm.default", Phase.FORWARD, 0, f"layers.{b}", (h, 1 + b), (sid,), 0))
        storages.append(StorageRecord(sid, 64, len(ops) - 1, None, frozenset(), "", (2, 8), "float32"))
        h, sid = sid, sid + 1
    return Trace(mode="inference", fx=torch.fx.Graph(), ops=tuple(ops), storages=tuple(storages), optimizer=None)


def test_an_op_outside_the_stack_between_two_blocks_is_the_next_blocks() -> None:
    lay = layout(_drawn(4), Stacked("layers"))
    # ops: mm_0, draw_1, mm_1, draw_2, mm_2, draw_3, mm_3; each draw sits between blocks b - 1 and b
    # in one phase, so it is block b's, first in its run
    assert lay.kind == ((0, 0, 0), (1, 0, 0), (1, 0, 1), (2, 0, 0), (2, 0, 1), (3, 0, 0), (3, 0, 1))
    assert lay.runs == (((0, 1),), ((1, 3),), ((3, 5),), ((5, 7),))
    # draw_1 (op 1) makes r_1, sid 6 (after x and 4 weights, then h_0 = 5): output 0 of position 0
    assert lay.owner[6] == (1, ("o", 0, 0, 0))
    whole, expected = repeat_blocks(_drawn(4), "layers", 6), _drawn(6, before=(1, 2, 3, 4, 5))
    assert whole.ops == expected.ops and whole.storages == expected.storages  # each placed block draws first


def test_an_op_of_another_phase_between_two_blocks_is_unrepeatable() -> None:
    # mm_0, mm_1, draw_2, mm_2, mm_3: draw_2 in another phase is no block's, so blocks 1 and 2 do not meet
    with pytest.raises(Unrepeatable, match="ops outside the stack between two of its blocks"):
        layout(_drawn(4, before=(2,), phase=Phase.LOSS), Stacked("layers"))


@pytest.mark.parametrize("trace, prefix, words", [
    (chain(4), "blocks", "no op ran in the blocks"),  # no module under blocks.
    (chain(5), "layers", "an op in block 4 of a stack cut to 4"),  # five recorded, four expected
], ids=["no_blocks", "five_blocks"])
def test_a_recording_that_is_not_cut_to_four_blocks_is_unrepeatable(trace: Trace, prefix: str, words: str) -> None:
    with pytest.raises(Unrepeatable, match=words):
        layout(trace, Stacked(prefix))


@pytest.mark.parametrize("where, path, index, block", [
    (Stacked("layers"), "layers.2.mlp.fc", 2, 2),
    (Stacked("layers", 2), "layers.5.mlp", 5, 2),  # two children a block: child 5 is in block 5 // 2
    (Stacked(""), "3.fc", 3, 3),  # the model itself is the stack
    (Stacked("layers"), "layers.norm", None, None),  # a child that is no number
    (Stacked("layers"), "layersX.1", None, None),  # a prefix of the name, not a parent
    (Stacked("model.layers"), "layers.1", None, None),
])
def test_stacked_finds_the_child_a_path_is_in(where: Stacked, path: str, index: int | None,
                                              block: int | None) -> None:
    assert where.index(path) == index
    assert where.block_of(path) == block


@pytest.mark.parametrize("where, path, source, target, moved", [
    (Stacked("layers"), "layers.1.attn.weight", 1, 7, "layers.7.attn.weight"),
    (Stacked("layers", 2), "layers.3.mlp", 1, 4, "layers.9.mlp"),  # child 3 is the 2nd of block 1: 4 * 2 + 1
    (Stacked(""), "2.fc", 2, 0, "0.fc"),
    (Stacked("layers"), "layers.11", 11, 12, "layers.12"),  # two digits: the whole number moves
])
def test_stacked_renames_a_path_into_another_block(where: Stacked, path: str, source: int, target: int,
                                                   moved: str) -> None:
    assert where.renamed(path, source, target) == moved
