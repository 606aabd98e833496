"""plan --policy's text (graphmem.report.policy_text) and emitted module (policy_file) for a
selective mix, on a PolicyPlan built by hand: the numbers are the 4-block GPT's of
docs/preflight.md with --policy-save matmuls."""

from __future__ import annotations

from fractions import Fraction

from graphmem.preflight.budget import Budget
from graphmem.preflight.policy.search import CheckpointChoice, PolicyPlan
from graphmem.report.policy_file import options_of, render_policy_module
from graphmem.report.policy_text import policy_section

_ALL_SELECTIVE = CheckpointChoice((0, 1, 2, 3), (0, 1, 2, 3), 5_976_000, 5_976_000, 0, 0.0, False)
_CHOSEN = CheckpointChoice((0, 1, 2, 3), (0, 2, 3), 5_680_344, 5_680_344, 16_777_216, 0.048, True)
_LOWEST = CheckpointChoice((0, 1, 2), (1,), 5_670_000, 5_670_000, 33_554_432, 0.096, True)


def _plan() -> PolicyPlan:
    return PolicyPlan("Block", tuple(f"blocks.{i}" for i in range(4)), Budget(5_800_000, Fraction(0), "5800000B"),
                      _CHOSEN, _LOWEST, (_ALL_SELECTIVE, _CHOSEN, _LOWEST), 3, 6_778_072, True, (), False,
                      "CBC", 9, 2, save=("matmuls",), saved_ops=("aten.addmm", "aten.mm"))


def test_the_front_marks_only_the_chosen_mix() -> None:
    # the first point checkpoints the same blocks as the chosen one, all four selective
    text = policy_section(_plan(), lambda n: f"{n} B")
    marked = [line for line in text.splitlines() if "<- chosen" in line]
    assert len(marked) == 1 and marked[0].startswith("1 whole; 0,2-3 selective"), marked


def test_the_emitted_module_names_the_selective_blocks_and_their_ops() -> None:
    assert options_of(_plan(), _CHOSEN) == ("--checkpoint Block --checkpoint-blocks 0-3 --checkpoint-save matmuls "
                                            "--checkpoint-save-blocks 0,2-3")
    namespace: dict[str, object] = {}
    exec(compile(render_policy_module(_plan(), "test"), "policy.py", "exec"), namespace)
    assert namespace["CHECKPOINTED"] == (0, 1, 2, 3)
    assert namespace["SELECTIVE"] == (0, 2, 3)
    assert namespace["SAVE_OPS"] == ("aten.addmm", "aten.mm")
    assert namespace["TORCHTITAN_ACTIVATION_CHECKPOINT"] is None
