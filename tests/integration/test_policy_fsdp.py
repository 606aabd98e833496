"""plan --policy under --parallel fsdp=2 against real FSDP2: the emitted module (apply_policy, then
its apply_fsdp with the reshard_after_forward chosen) run for real over 2 gloo ranks on CPU
(tests/dist_oracles.py) has the peak graphmem verified, to the byte, on every rank, and fits.

The GPT of docs/preflight.md (examples/gpt.py, 4 blocks of dim 64, vocab 500, batch 2 x 64):
at 6,200,000 B nothing needs checkpointing whether the blocks keep their parameters after forward
or not, so the plan keeps them (no all-gather in backward); at 5,000,000 B keeping them would cost
three blocks' recompute where resharding costs one, so the plan reshards (FSDP2's default); at
5,900,000 B the blocks reshard with none checkpointed, and the last two units keep their
parameters (--fsdp-keep-units 2-3: the room left holds two units' unsharded parameters).
"""

from __future__ import annotations

import importlib.util
import os
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch.distributed as dist
from click.testing import CliRunner

from graphmem.cli import main
from graphmem.job import make_job
from graphmem.preflight.budget import Budget
from graphmem.preflight.plan import make_plan
from graphmem.report.policy_file import render_policy_module
from tests.conftest import ROOT
from tests.dist_oracles import measure_distributed
from tests.optional import extended, needs

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

_EMITTED = "GRAPHMEM_TEST_EMITTED_POLICY"  # the emitted module's path, for the spawned ranks
_KWARGS = {"layers": 4, "dim": 64, "vocab": 500}
# one block's parameters: ln1 2*64, qkv 64*192+192, proj 64*64+64, ln2 2*64, fc 64*256+256, out 256*64+64
_BLOCK_PARAMS = 128 + 12_480 + 4_160 + 128 + 16_640 + 16_448


def _load(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_with_policy() -> Any:
    """(in each rank) examples/gpt.py's GPT with the emitted module's apply_policy."""
    gpt = _load(str(ROOT / "examples" / "gpt.py"), "examples_gpt")
    return _load(os.environ[_EMITTED], "emitted_policy").apply_policy(gpt.GPT(**_KWARGS))


def shard_with_policy(model: Any, mesh: Any) -> Any:
    """(in each rank) the emitted module's apply_fsdp."""
    return _load(os.environ[_EMITTED], "emitted_policy").apply_fsdp(model, mesh)


@needs("pulp")
@pytest.mark.slow  # the plan (two settings, each 4 recordings and its analyses) and a real 2-rank run: ~1 min
@pytest.mark.parametrize("budget, keeps, blocks, units", [
    pytest.param(6_200_000, True, (), (), marks=extended("the budget where the last units keep their parameters "
                                                         "runs by default")),
    pytest.param(5_000_000, False, (0,), (), marks=extended("the budget where the last units keep their "
                                                             "parameters runs by default")),
    (5_900_000, False, (), (2, 3))])
def test_emitted_policy_under_real_fsdp2_has_the_verified_peak_and_fits(
        budget: int, keeps: bool, blocks: tuple[int, ...], units: tuple[int, ...], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    job = make_job(str(ROOT / "examples" / "gpt.py") + ":GPT", "2x64:int64", mode="train", loss="cross_entropy",
                   kwargs=_KWARGS, parallel="fsdp=2")
    plan = make_plan(job, Budget(budget, Fraction(0), f"{budget}B"), policy=True).policy
    assert plan is not None and plan.chosen is not None and plan.sharding is not None
    assert plan.chosen.blocks == blocks and (plan.sharding.reshard_after_forward is False) == keeps
    assert plan.chosen.keep_units == units
    # what keeping saves: every block's unsharded fp32 parameters, all-gathered again in backward
    saved = {o.reshard_after_forward: o.saved_bytes for o in plan.sharding.options}
    assert saved == {None: len(units) * _BLOCK_PARAMS * 4, False: 4 * _BLOCK_PARAMS * 4}
    path = tmp_path / "policy.py"
    path.write_text(render_policy_module(plan, "test"), encoding="utf-8")
    monkeypatch.setenv(_EMITTED, str(path))
    measured = measure_distributed(f"{__name__}:build_with_policy", ["2x64:int64"], strategy="fsdp", world_size=2,
                                   loss="cross_entropy", int_high=500, shard=f"{__name__}:shard_with_policy")
    assert [m.peak_bytes for m in measured] == [plan.chosen.peak_bytes] * 2
    assert all(m.peak_bytes <= budget for m in measured)


def build_decoder_with_policy() -> Any:
    """(in each rank) examples/decoder.py's Decoder with the emitted module's apply_policy."""
    decoder = _load(str(ROOT / "examples" / "decoder.py"), "examples_decoder")
    return _load(os.environ[_EMITTED], "emitted_policy").apply_policy(decoder.Decoder())


def build_decoder() -> Any:
    return _load(str(ROOT / "examples" / "decoder.py"), "examples_decoder").Decoder()


@needs("pulp")
@pytest.mark.slow  # the plan (both units, two settings each) and two real 2-rank runs: ~1 min
def test_finer_units_fit_where_the_layers_as_units_need_more_than_any_checkpointing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/decoder.py (4 layers of dim 256, 16 tokens: parameters, not activations, make the
    peak) at 36,000,000 B: with its layers as FSDP2 units no checkpointing fits (the lowest peak, every
    layer's unsharded parameters and gradients at their turn, is over), with its attention and MLP
    modules as the units it fits with nothing checkpointed.  Both run for real over 2 gloo ranks."""
    budget = 36_000_000
    job = make_job(str(ROOT / "examples" / "decoder.py") + ":Decoder", "1x16:int64", mode="train",
                   loss="cross_entropy", parallel="fsdp=2")
    plan = make_plan(job, Budget(budget, Fraction(0), f"{budget}B"), policy=True).policy
    assert plan is not None and plan.chosen is not None and plan.sharding is not None
    assert plan.sharding.units == ("Attention", "MLP") and plan.sharding.finer
    assert plan.chosen.blocks == () and plan.chosen.recompute_flops == 0
    layers = [o for o in plan.sharding.options if o.units == ("Layer",)]
    assert len(layers) == 2 and all(o.chosen is None and o.lowest.peak_bytes > budget for o in layers)
    path = tmp_path / "policy.py"
    path.write_text(render_policy_module(plan, "test"), encoding="utf-8")
    assert "FSDP_UNITS = ('Attention', 'MLP')" in path.read_text(encoding="utf-8")
    monkeypatch.setenv(_EMITTED, str(path))
    measured = measure_distributed(f"{__name__}:build_decoder_with_policy", ["1x16:int64"], strategy="fsdp",
                                   world_size=2, loss="cross_entropy", int_high=500,
                                   shard=f"{__name__}:shard_with_policy")
    assert [m.peak_bytes for m in measured] == [plan.chosen.peak_bytes] * 2
    assert all(m.peak_bytes <= budget for m in measured)
    # the job's own units, nothing checkpointed (FSDP2's default): over the budget, as analysed
    as_given = next(o for o in layers if o.reshard_after_forward is None)
    real = measure_distributed(f"{__name__}:build_decoder", ["1x16:int64"], strategy="fsdp", world_size=2,
                               loss="cross_entropy", int_high=500, units=["Layer"])
    assert [m.peak_bytes for m in real] == [plan.baseline_bytes] * 2
    assert min(m.peak_bytes for m in real) > budget and as_given.lowest.peak_bytes > budget


def test_policy_with_other_parallel_layouts_is_refused_in_one_line() -> None:
    result = CliRunner().invoke(main, ["plan", str(ROOT / "examples" / "gpt.py") + ":GPT", "--input", "2x64:int64",
                                       "--parallel", "ddp=2", "--budget", "5MiB", "--policy"])
    assert result.exit_code == 3  # a feature not modelled (docs/exit-codes.md)
    assert "Error: --policy with --parallel ddp=2: only fsdp=N alone" in result.output
