"""plan --policy on a GPU: the composite ranks choices by tensor bytes, the caching allocator's
blocks can rank them otherwise.  A choice analysed anyway (a recording: every block checkpointed)
that the analysis puts lower than the front's last point is the lowest, and one that fits when no
front point does is the choice (llama-3-8b at 1x8192 on an H100: every block checkpointed reserves
85.60 GiB, the front's lowest, blocks 0-22, 89.41 GiB)."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from graphmem.preflight.budget import Budget
from graphmem.preflight.policy.search import CheckpointChoice, _chosen, _lowest

GIB = 2**30


class _Verify:
    """The parts of search._Verifier that _chosen and _lowest read: analysed peaks by choice."""

    def __init__(self, analysed: dict[tuple[int, ...], int], tensors: dict[tuple[int, ...], int], budget: int) -> None:
        self.done, self.tensors = analysed, tensors
        self.budget = Budget(budget, Fraction(0), f"{budget}B")
        self.composite: Any = type("C", (), {"peak": lambda _, c: tensors[c]})()
        self.outside = 0

    def analyse(self, choices: Any) -> None:
        assert all(c in self.done for c in choices), choices

    def choice(self, choice: tuple[int, ...]) -> CheckpointChoice:
        return CheckpointChoice(tuple(i for i, v in enumerate(choice) if v), (), self.done[choice],
                                self.tensors[choice], sum(choice), 0.0, self.budget.fits(self.done[choice]))


# three blocks: the front ends at blocks 0-1 (equal tensor bytes to all three, less recompute)
_TENSORS = {(0, 0, 0): 100 * GIB, (1, 0, 0): 90 * GIB, (1, 1, 0): 77 * GIB, (1, 1, 1): 77 * GIB}
_ANALYSED = {(0, 0, 0): 115 * GIB, (1, 0, 0): 100 * GIB, (1, 1, 0): 89 * GIB, (1, 1, 1): 86 * GIB}
_FRONT = [(0, 0, 0), (1, 0, 0), (1, 1, 0)]


def test_the_lowest_is_the_lowest_analysed() -> None:
    verify = _Verify(_ANALYSED, _TENSORS, 80 * GIB)
    assert _lowest(verify, _FRONT[-1]).blocks == (0, 1, 2)


def test_a_recording_under_the_budget_is_chosen_when_no_front_point_is() -> None:
    verify = _Verify(_ANALYSED, _TENSORS, 87 * GIB)
    chosen = _chosen(verify, _FRONT)
    assert chosen is not None and chosen.blocks == (0, 1, 2) and chosen.peak_bytes == 86 * GIB


def test_the_front_answers_first() -> None:
    verify = _Verify(_ANALYSED, _TENSORS, 95 * GIB)
    chosen = _chosen(verify, _FRONT)
    assert chosen is not None and chosen.blocks == (0, 1)
    # on ties of peak and recompute the front's last point stays the lowest
    tie = _Verify({**_ANALYSED, (1, 1, 1): 89 * GIB}, _TENSORS, 80 * GIB)
    assert _lowest(tie, _FRONT[-1]).blocks == (0, 1)
