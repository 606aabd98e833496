"""plan --policy --parallel fsdp=N's text, JSON and emitted module on a PolicyPlan built by hand:
the numbers are the 4-block GPT's over 2 ranks of docs/preflight.md at 6200000B (every block's
parameters kept after forward, none checkpointed)."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

from graphmem.preflight.budget import Budget
from graphmem.preflight.policy.search import CheckpointChoice, PolicyPlan, Sharding, ShardingOption
from graphmem.report.policy_file import options_of, render_policy_module
from graphmem.report.policy_text import policy_section, policy_to_dict

_GATHERED = 4 * 49_984 * 4  # four blocks' fp32 parameters, gathered again in backward when resharded
_RESHARDED = CheckpointChoice((), (), 5_383_128, 5_383_128, 0, 0.0, True, _GATHERED)
_KEPT = CheckpointChoice((), (), 6_182_872, 6_182_872, 0, 0.0, True, 0)
_KEPT_LOWEST = CheckpointChoice((0, 1, 2, 3), (), 4_286_808, 4_286_808, 67_108_864, 0.191, True, 0)


def _plan() -> PolicyPlan:
    sharding = Sharding("fsdp=2", ("Block",), None, None, False, (
        ShardingOption(None, _RESHARDED, _RESHARDED, _GATHERED, 0),
        ShardingOption(False, _KEPT, _KEPT_LOWEST, 0, _GATHERED)))
    return PolicyPlan("Block", tuple(f"blocks.{i}" for i in range(4)), Budget(6_200_000, Fraction(0), "6200000B"),
                      _KEPT, _KEPT_LOWEST, (_KEPT, _KEPT_LOWEST), 5, 5_383_128, True, (), False, "CBC", 4, 3,
                      sharding=sharding)


def test_the_options_analyse_the_kept_parameters() -> None:
    assert options_of(_plan(), _KEPT) == "--parallel fsdp=2 --reshard-after-forward false"


def test_the_text_shows_each_setting_and_marks_the_chosen_one() -> None:
    text = policy_section(_plan(), lambda n: f"{n:,} B")
    assert "keeping its parameters after forward (reshard_after_forward=False: 799,744 B less all-gathered" \
        in " ".join(text.split())
    marked = [line for line in text.splitlines() if line.startswith("kept until backward")]
    assert len(marked) == 1 and marked[0].endswith("<- chosen")


def test_the_json_carries_the_settings() -> None:
    sharding = policy_to_dict(_plan())["sharding"]
    assert sharding["reshard_after_forward"] is False and sharding["fsdp_units"] == ["Block"]
    assert sharding["torchtitan_fsdp_reshard_after_forward"] == "never"
    assert [o["saved_bytes"] for o in sharding["options"]] == [0, _GATHERED]


def test_the_emitted_module_shards_as_analysed() -> None:
    namespace: dict[str, object] = {}
    exec(compile(render_policy_module(_plan(), "test"), "policy.py", "exec"), namespace)
    assert namespace["RESHARD_AFTER_FORWARD"] is False and namespace["FSDP_UNITS"] == ("Block",)
    assert namespace["TORCHTITAN_FSDP_RESHARD_AFTER_FORWARD"] == "never" and callable(namespace["apply_fsdp"])


# at 5900000B: the units reshard, none checkpointed, and the last two keep their parameters; block 0
# keeping its qkv output is made up here, to show both refinements in one plan
_UNITS_KEPT = CheckpointChoice((0,), (), 5_782_616, 5_379_032, 1_000, 0.01, True, _GATHERED // 2,
                               kept=((0, ("qkv:matmuls",)),), keep_units=(2, 3))
_PER_BLOCK = CheckpointChoice((0,), (), 5_700_000, 5_379_032, 2_000, 0.02, True, _GATHERED)


def _refined() -> PolicyPlan:
    sharding = Sharding("fsdp=2", ("Block",), None, None, None, (
        ShardingOption(None, _UNITS_KEPT, _RESHARDED, _GATHERED // 2, _GATHERED // 2),
        ShardingOption(False, _KEPT_LOWEST, _KEPT_LOWEST, 0, _GATHERED)))
    return PolicyPlan("Block", tuple(f"blocks.{i}" for i in range(4)), Budget(5_900_000, Fraction(0), "5900000B"),
                      _UNITS_KEPT, _KEPT_LOWEST, (_PER_BLOCK, _KEPT_LOWEST), 2, 5_383_128, True, (), False, "CBC", 4,
                      5, sharding=sharding, per_block=_PER_BLOCK)


def test_units_keeping_their_parameters_and_ops_kept_are_said_everywhere() -> None:
    plan = _refined()
    assert options_of(plan, _UNITS_KEPT) == ("--checkpoint Block --checkpoint-blocks 0 --checkpoint-save-in "
                                             "0=qkv:matmuls --parallel fsdp=2 --fsdp-keep-units 2-3")
    text = " ".join(policy_section(plan, lambda n: f"{n:,} B").split())
    assert "FSDP2 units 2-3 keeping their parameters after forward (399,872 B less all-gathered" in text
    assert "resharded (FSDP2's default); units 2-3 kept" in text
    assert "<- chosen: the row above, keeping single ops' outputs" in text
    chosen = policy_to_dict(plan)["chosen"]
    assert chosen["fsdp_keep_units"] == "2-3" and chosen["checkpoint_save_in"] == "0=qkv:matmuls"
    namespace: dict[str, object] = {}
    exec(compile(render_policy_module(plan, "test"), "policy.py", "exec"), namespace)
    assert namespace["KEEP_UNITS"] == (2, 3) and namespace["RESHARD_AFTER_FORWARD"] is None
    assert namespace["KEPT"] == {0: (("qkv", ("aten.addmm", "aten.baddbmm", "aten.bmm", "aten.mm")),)}


def test_finer_units_chosen_or_only_tried_are_said() -> None:
    """Units split finer (made-up numbers): the chosen ones in the table, Run it and the emitted
    module; finer units tried and found no lower, in the title and JSON."""
    base = _plan()
    assert base.sharding is not None
    finer = Sharding("fsdp=2", ("Attention", "MLP"), None, None, None, (
        ShardingOption(None, None, _RESHARDED, _GATHERED, 0, ("Block",)),
        ShardingOption(None, _KEPT, _KEPT_LOWEST, _GATHERED, 0, ("Attention", "MLP"))))
    plan = replace(base, chosen=_KEPT, sharding=finer)
    assert options_of(plan, _KEPT) == "--parallel fsdp=2 --fsdp-units Attention,MLP"
    rows = [line for line in policy_section(plan, lambda n: f"{n:,} B").splitlines() if line.endswith("<- chosen")
            and ": " in line]  # the settings' table (the front's has its own mark)
    assert len(rows) == 1 and rows[0].startswith("Attention, MLP: resharded")
    namespace: dict[str, object] = {}
    exec(compile(render_policy_module(plan, "test"), "policy.py", "exec"), namespace)
    assert namespace["FSDP_UNITS"] == ("Attention", "MLP")
    tried = replace(base, sharding=replace(base.sharding, probed=(("Attention", "MLP"), 7_000_000, 6_182_872)))
    text = " ".join(policy_section(tried, lambda n: f"{n:,} B").split())
    assert "finer units (Attention, MLP), with the blocks these need checkpointed, peak at 7,000,000 B, not below " \
           "6,182,872 B: not searched further" in text
    assert policy_to_dict(tried)["sharding"]["finer_units_tried"] == {
        "fsdp_units": ["Attention", "MLP"], "peak_bytes": 7_000_000, "own_units_peak_bytes": 6_182_872}
