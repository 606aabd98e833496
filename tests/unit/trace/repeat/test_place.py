"""graphmem.trace.repeat.place on hand-built recordings (tests/unit/trace/repeat/chains.py): a
recording cut to four blocks, placed by offset for a stack of L, is the recording of L blocks
written out by hand, op for op and storage for storage.  No torch runs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from graphmem.records import OpRecord, Phase, Trace
from graphmem.trace.repeat.place import Unrepeatable, placed_calls, repeat_blocks
from graphmem.trace.symbolic import trace_at
from tests.unit.trace.repeat.chains import chain


def test_an_inference_chain_placed_for_six_blocks() -> None:
    whole = repeat_blocks(chain(4), "layers", 6)
    assert [op.module for op in whole.ops] == [f"layers.{b}" for b in range(6)]  # one mm per block
    # x = 0, w_b = 1 + b, h_b = 7 + b: block 0 reads (x, w_0), block b reads (h_{b-1}, w_b)
    assert [op.inputs for op in whole.ops] == [(0, 1), (7, 2), (8, 3), (9, 4), (10, 5), (11, 6)]
    assert [op.outputs for op in whole.ops] == [(7,), (8,), (9,), (10,), (11,), (12,)]
    # h_b made by op b, freed after op b + 1 reads it; the last one is the output
    assert [(s.created, s.released) for s in whole.storages[7:]] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5),
                                                                      (5, None)]
    assert [s.label for s in whole.storages[1:7]] == [f"layers.{b}.weight" for b in range(6)]
    expected = chain(6)
    assert whole.ops == expected.ops and whole.storages == expected.storages


def test_a_training_step_with_an_optimizer_placed_for_six_blocks() -> None:
    whole = repeat_blocks(chain(4, train=True, optimizer=True), "layers", 6)
    assert len(whole.ops) == 14  # 6 forward, the loss, 6 backward, the optimizer's one _foreach_add_
    assert len(whole.storages) == 26  # x, 6 weights, 6 h, the loss, 6 input gradients d, 6 weight gradients g
    # loss = 1 + 2*6 = 13; block b's backward is op 12 - b and makes d_b = 24 - 2b, g_b = 25 - 2b
    # block 2's (op 10) reads h_1 = 7 + 1, w_2 = 3 and d_3 = 18; makes d_2 = 20, g_2 = 21
    assert whole.ops[10].module == "layers.2"
    assert (whole.ops[10].inputs, whole.ops[10].outputs) == ((8, 3, 18), (20, 21))
    assert whole.ops[7].inputs == (11, 6, 13)  # block 5's backward (op 12 - 5): h_4 = 11, w_5 = 6, the loss
    # the _foreach_add_ takes w_0..w_5 = 1..6, then g_0..g_5 = 25, 23, ..., 15
    assert whole.ops[13].inputs == (1, 2, 3, 4, 5, 6, 25, 23, 21, 19, 17, 15)
    assert (whole.storages[8].created, whole.storages[8].released) == (1, 10)  # h_1: block 1, until block 2's backward
    assert (whole.storages[13].created, whole.storages[13].released) == (6, 7)  # the loss, until block 5's backward
    assert (whole.storages[24].created, whole.storages[24].released) == (12, 12)  # d_0: nothing reads it


@pytest.mark.parametrize("length", [4, 5, 6, 9, 32])
@pytest.mark.parametrize("kind", [{}, {"train": True}, {"train": True, "optimizer": True}],
                         ids=["inference", "train", "train_optimizer"])
def test_the_placed_recording_is_the_whole_recording(kind: dict[str, bool], length: int) -> None:
    whole, expected = repeat_blocks(chain(4, **kind), "layers", length), chain(length, **kind)
    assert whole.ops == expected.ops
    assert whole.storages == expected.storages


def test_blocks_of_two_children_are_placed_two_at_a_time() -> None:
    """Checkpointing every second block: the unit that repeats is two children (8 recorded)."""
    whole = repeat_blocks(chain(8, train=True), "layers", 12, period=2)
    expected = chain(12, train=True)
    assert whole.ops == expected.ops and whole.storages == expected.storages


def test_placed_at_the_recorded_length_the_recording_checks_itself() -> None:
    cut = chain(4, train=True, optimizer=True)
    again = repeat_blocks(cut, "layers", 4, graph=False)  # blocks 0, 1, 3 and block 2 as a copy of block 1
    assert again.ops == cut.ops and again.storages == cut.storages
    assert again.fx is cut.fx  # graph=False keeps the cut graph


def test_sizes_as_expressions_are_placed_with_their_storages() -> None:
    whole = repeat_blocks(chain(4, sizes=True), "layers", 6)
    assert whole.sizes is not None
    assert set(whole.sizes.storages) == {0, 7, 8, 9, 10, 11, 12}  # x and h_0..h_5 (7 + b) scale with B
    assert set(whole.sizes.ops) == {0, 1, 2, 3, 4, 5}  # every mm's FLOPs
    assert whole.sizes == chain(6, sizes=True).sizes


def test_evaluating_then_placing_is_placing_then_evaluating() -> None:
    cut = chain(4, train=True, sizes=True)
    placed_then_at = trace_at(repeat_blocks(cut, "layers", 7), 5)
    at_then_placed = repeat_blocks(trace_at(cut, 5), "layers", 7)
    assert placed_then_at.ops == at_then_placed.ops and placed_then_at.storages == at_then_placed.storages
    assert placed_then_at.storages[8].nbytes == 160  # h_0 (sid 1 + 7): 4 bytes * B=5 * H=8


def _with_op(trace: Trace, index: int, **changes: Any) -> Trace:
    return replace(trace, ops=tuple(replace(op, **changes) if op.index == index else op for op in trace.ops))


def _reading(trace: Trace, sid: int) -> Trace:
    """``trace`` with one more op at its end, outside the stack, that reads storage ``sid``."""
    last = OpRecord(len(trace.ops), "aten.sum.default", Phase.FORWARD, 0, "", (sid,), (), 0)
    return replace(trace, ops=(*trace.ops, last))


@pytest.mark.parametrize("trace, length, period, words", [
    (chain(4), 3, 1, "a stack of 3 blocks is shorter than the 4 recorded"),
    (chain(8), 13, 2, "a stack of 13 does not split into blocks of 2"),
    # block 2's mm reads x too: 3 inputs where block 1's reads 2
    (_with_op(chain(4), 2, inputs=(7, 3, 0)), 6, 1, "block 1 and block 2 run different ops"),
    # block 3's mm reads h_1 (sid 6) too
    (_with_op(chain(4), 3, inputs=(7, 4, 6)), 6, 1, "a block reads a block two away"),
    # after the blocks, an op reads h_1 (sid 6): which of the middle blocks' h would it be?
    (_reading(chain(4), 6), 6, 1, "an op outside the stack reads a block between the first and the last"),
    # the optimizer's _foreach_add_ (op 9) with scratch: it would grow with the stack
    (_with_op(chain(4, train=True, optimizer=True), 9, scratch_bytes=16), 6, 1, "multi-tensor op with scratch"),
], ids=["short", "period", "different_ops", "two_away", "outside_reads_middle", "shared_scratch"])
def test_a_recording_that_does_not_repeat_by_offset_is_unrepeatable(trace: Trace, length: int, period: int,
                                                                    words: str) -> None:
    with pytest.raises(Unrepeatable, match=words):
        repeat_blocks(trace, "layers", length, period=period)


def test_placed_calls_counts_each_call_as_the_whole_model_makes_it() -> None:
    # calls before ops 0-3 (blocks 0-3) of a stack of 6: block 0 and 3 once (the first and last),
    # block 1 for every block between (6 - 2), block 2 never (block 1's copies stand for it);
    # before an op past the recording (99): once
    assert placed_calls(chain(4), "layers", 6, [0, 1, 2, 3, 99]) == [1, 4, 0, 1, 1]
    # two children a block, 12 children: op 2 is child 2, block 1: 12 // 2 - 2 times; op 4 is block 2
    assert placed_calls(chain(8), "layers", 12, [2, 4], period=2) == [4, 0]
