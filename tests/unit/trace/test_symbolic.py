"""graphmem.trace.symbolic.trace_at on hand-built recordings with the batch as a symbol B:
each size evaluated where the guards hold, refused where they do not.  No torch runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import sympy
import torch

from graphmem.records import OpRecord, Phase, Role, StorageRecord, SymbolicSizes, Trace
from graphmem.trace.symbolic import trace_at

B = sympy.Symbol("B", positive=True, integer=True)


def _trace(guards: tuple[object, ...] = ()) -> Trace:
    """Linear(8, 16) with no bias at B = 2 (the hint): x (2 x 8), the weight (16 x 8), the
    output (2 x 16), float32; the op's scratch is 8*B bytes (made up: any expression will do)."""
    storages = (StorageRecord(0, 4 * 2 * 8, -1, None, frozenset({Role.INPUT}), "x", (2, 8), "float32"),
                StorageRecord(1, 4 * 16 * 8, -1, None, frozenset({Role.PARAMETER}), "weight", (16, 8), "float32"),
                StorageRecord(2, 4 * 2 * 16, 0, None, frozenset({Role.OUTPUT}), "", (2, 16), "float32"))
    ops = (OpRecord(0, "aten.mm.default", Phase.FORWARD, 0, "", (0, 1), (2,), scratch_bytes=8 * 2,
                    flops=2 * 2 * 8 * 16),)
    sizes = SymbolicSizes(name="B", symbol=B, hint=2,
                          storages={0: (4 * B * 8, (B, 8)), 2: (4 * B * 16, (B, 16))},
                          ops={0: (8 * B, 2 * B * 8 * 16)}, guards=guards)
    return Trace(mode="inference", fx=torch.fx.Graph(), ops=ops, storages=storages, optimizer=None, sizes=sizes)


def test_sizes_are_evaluated_at_the_value() -> None:
    at = trace_at(_trace(), 5)
    assert [s.nbytes for s in at.storages] == [160, 512, 320]  # 4*5*8; the weight's own 4*16*8; 4*5*16
    assert [s.shape for s in at.storages] == [(5, 8), (16, 8), (5, 16)]
    assert (at.ops[0].scratch_bytes, at.ops[0].flops) == (40, 1280)  # 8*5; 2*5*8*16
    assert at.sizes is not None and at.sizes.hint == 5  # now recorded, as it were, at 5


def test_back_at_the_hint_is_the_recording() -> None:
    trace = _trace()
    assert trace_at(trace, 2) is trace
    again = trace_at(trace_at(trace, 7), 2)
    assert again.ops == trace.ops and again.storages == trace.storages


def test_a_value_outside_the_guards_is_refused() -> None:
    trace = _trace(guards=(sympy.Le(B, 16),))  # the step decided something on B <= 16
    assert trace_at(trace, 16).storages[0].nbytes == 512  # 4*16*8
    with pytest.raises(ValueError, match="B=17 is outside the recording's guards"):
        trace_at(trace, 17)


@pytest.mark.parametrize("value", [0, 1])
def test_sizes_0_and_1_are_never_the_recorded_step(value: int) -> None:
    """FakeTensor specialises sizes 0 and 1: a recording at B >= 2 says nothing about them."""
    with pytest.raises(ValueError, match="outside the recording's guards"):
        trace_at(_trace(), value)


def test_a_guard_on_another_symbol_holds_nowhere() -> None:
    sizes = _trace(guards=(sympy.Le(B, sympy.Symbol("S")),)).sizes
    assert sizes is not None and not sizes.holds(3)


def test_a_hint_below_2_is_refused() -> None:
    with pytest.raises(ValueError, match="hint 1 < 2"):
        SymbolicSizes(name="B", symbol=B, hint=1, storages={}, ops={}, guards=())


def test_a_trace_without_a_formula_is_refused() -> None:
    with pytest.raises(ValueError, match="keeps no size formula"):
        trace_at(replace(_trace(), sizes=None), 3)
