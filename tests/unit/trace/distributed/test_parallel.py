"""--parallel: parsing, the ranks that differ, and per-rank sizes checked by independent sums.

The per-rank peaks are compared with real multi-process runs in
tests/integration/test_parallel_oracle.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import graphmem
from graphmem.cli import main
from graphmem.errors import UserInputError
from graphmem.job.parallel import parse_parallel
from graphmem.memory.results import Category, ModeReport
from tests.conftest import ROOT

MLP = "tests.models:MLP"


class Uneven(nn.Module):
    """Dim 0 of 5 and 3: FSDP2 over 4 ranks pads them, and the last ranks hold fewer rows."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 5), nn.Linear(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _start(mode: ModeReport, category: Category) -> int:
    """Bytes of ``category`` live before the first op (what the strategy left)."""
    return sum(life.nbytes for life in mode.lifetimes if life.category == category and life.start == -1)


@pytest.mark.parametrize("text, words", [
    ("cp=2", "not supported yet"), ("bogus=2", "unknown strategy"), ("zero1=2,tp=2", "combinations"),
    ("fsdp", "malformed"),
    ("fsdp=0", "positive"), ("ddp=2,zero1=2", "combinations"), ("fsdp=2,fsdp=2", "combinations"),
])
def test_bad_specs_are_refused_with_the_reason(text: str, words: str) -> None:
    with pytest.raises(UserInputError, match=words):
        parse_parallel(text)


@pytest.mark.parametrize("args, words", [
    (["--parallel", "cp=2"], "not supported yet"),
    (["--parallel", "tp=2"], "no tensor-parallel plan"),
    (["--parallel", "fsdp=2", "--fsdp-units", "Block"], "no module of class Block"),
    (["--tp-plan", "x:PLAN"], "need --parallel"),
])
def test_a_bad_spec_is_one_line_and_exit_2(args: list[str], words: str) -> None:
    result = CliRunner().invoke(main, ["analyze", str(ROOT / "examples" / "mlp.py") + ":MLP", "--input", "4x1000",
                                       "--mode", "train", *args])
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_world_size_is_the_product_of_degrees() -> None:
    assert parse_parallel("ddp=2,fsdp=4").world_size == 8
    assert parse_parallel("fsdp=8").degree("ddp") == 1


def test_fsdp_shards_pad_dim_0_and_the_ranks_that_differ_are_recorded() -> None:
    report = graphmem.analyze(Uneven, ["2x8"], mode="train", optimizer="sgd", parallel="fsdp=4",
                              fsdp_units="Linear")
    assert report.train is not None
    model = Uneven()
    world = 4
    padded = sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * p.element_size()
                 for p in model.parameters())
    seen = {r.rank: r for r in report.train.ranks}
    assert sorted(rank for r in report.train.ranks for rank in r.ranks) == list(range(world))
    for r in report.train.ranks:
        assert _start(r.report, Category.PARAMETER) == padded, "every rank holds padded shards of equal size"
    # rows per rank: weight 5 rows -> 2, 2, 1, 0; weight 3 rows -> 1, 1, 1, 0: ranks 0 and 1 alike
    assert seen[0].ranks == (0, 1) and 2 in seen and 3 in seen
    assert report.train.peak_bytes == max(r.report.peak_bytes for r in report.train.ranks)


def test_ddp_keeps_buckets_as_large_as_the_parameters() -> None:
    report = graphmem.analyze(MLP, ["4x1000"], mode="train", optimizer="sgd", parallel="ddp=4")
    assert report.train is not None
    params = sum(p.numel() * p.element_size() for p in __import__("tests.models", fromlist=["MLP"]).MLP().parameters())
    assert _start(report.train, Category.PARAMETER) == params
    assert _start(report.train, Category.COMMUNICATION) == params
    assert len(report.train.ranks) == 1 and report.train.ranks[0].ranks == (0, 1, 2, 3)


def test_zero1_state_follows_the_engines_own_partition() -> None:
    """Adam's two moments per rank: twice the bytes of the parameters ZeroRedundancyOptimizer
    itself assigns to that rank (asked from the real class, under a fake process group)."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.models import MLP as Net

    world = 3
    report = graphmem.analyze(MLP, ["4x1000"], mode="train", optimizer="adam", parallel=f"zero1={world}")
    assert report.train is not None
    expected = {}
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            zero = ZeroRedundancyOptimizer(list(Net().parameters()), optimizer_class=torch.optim.Adam)
            mine = zero._partition_parameters()[rank]
            expected[rank] = sum(2 * p.numel() * p.element_size() for group in mine for p in group["params"])
        finally:
            dist.destroy_process_group()
    for r in report.train.ranks:
        state = [life for life in r.report.lifetimes if life.category == Category.OPTIMIZER_STATE]
        moments = sum(life.nbytes for life in state if life.nbytes > 8)  # the step counters are 4-8 B scalars
        assert moments == expected[r.rank], r.ranks


def test_json_lists_every_distinct_rank_and_the_maximum() -> None:
    import json

    result = CliRunner().invoke(main, ["analyze", "tests.models:MLP", "--input", "4x1000", "--mode", "train",
                                       "--parallel", "zero1=2", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    ranks = data["train"]["ranks"]
    assert data["parallel"] == "zero1=2" and [r["ranks"] for r in ranks] in ([[0], [1]], [[1], [0]])
    assert data["train"]["peak_bytes"] == max(r["peak_bytes"] for r in ranks) == ranks[0]["peak_bytes"]


def test_check_compares_the_highest_rank() -> None:
    report = graphmem.analyze(MLP, ["4x1000"], mode="train", parallel="zero1=2")
    assert report.train is not None
    peak = report.train.peak_bytes
    args = ["check", "tests.models:MLP", "--input", "4x1000", "--parallel", "zero1=2"]
    assert CliRunner().invoke(main, [*args, "--budget", f"{peak}B"]).exit_code == 0
    assert CliRunner().invoke(main, [*args, "--budget", f"{peak - 1}B"]).exit_code == 1


def test_the_users_model_is_left_untouched() -> None:
    model = Uneven()
    before = {name: p.clone() for name, p in model.named_parameters()}
    graphmem.analyze(model, ["2x8"], mode="train", parallel="fsdp=2", fsdp_units="Linear")
    assert type(model) is Uneven and type(model.layers[0]) is nn.Linear
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


def _shard_every_linear(model: nn.Module, mesh: object) -> None:
    """A user's own parallelisation function, as a trainer would call it."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def test_the_users_own_parallelize_runs_unchanged() -> None:
    mine = graphmem.analyze(MLP, ["4x1000"], mode="train", parallel="fsdp=2", parallelize=_shard_every_linear)
    built_in = graphmem.analyze(MLP, ["4x1000"], mode="train", parallel="fsdp=2", fsdp_units="Linear")
    assert mine.train is not None and built_in.train is not None
    assert mine.train.timeline == built_in.train.timeline


def test_a_failing_parallelize_names_the_function() -> None:
    def broken(model: nn.Module, mesh: object) -> None:
        raise ValueError("no such layer")

    with pytest.raises(UserInputError, match="broken failed.*no such layer"):
        graphmem.analyze(MLP, ["4x1000"], mode="train", parallel="fsdp=2", parallelize=broken)


def test_plan_offers_the_smallest_fsdp_degree_that_fits() -> None:
    from graphmem.job import make_job
    from graphmem.preflight import make_plan, parse_budget, resolve_budget

    at_2 = graphmem.analyze(MLP, ["4x1000"], mode="train", parallel="fsdp=2")
    assert at_2.train is not None
    budget = resolve_budget(parse_budget(f"{at_2.train.peak_bytes}B"), None)
    plan = make_plan(make_job(MLP, "4x1000", mode="train"), budget, world_size=8)
    fsdp = [r for r in plan.rows if str(r.changes.get("parallel", "")).startswith("fsdp=")
            and ":" not in r.changes["parallel"]]
    assert [r.changes["parallel"] for r in fsdp] == ["fsdp=2"]
    assert fsdp[0].fits and fsdp[0].peak_bytes == at_2.train.peak_bytes
