"""Pre-flight pieces by hand arithmetic: budgets, margins, symbolic inputs, the search,
the plan's formulas and ranking, and the CLI's exit codes."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from graphmem.cli import main
from graphmem.cuda.gpus import get_gpu
from graphmem.errors import UserInputError
from graphmem.job.spec import input_symbol, substitute, validate_inputs
from graphmem.memory.results import Category, Lifetime
from graphmem.preflight.budget import Budget, parse_budget, parse_margin, resolve_budget
from graphmem.preflight.changes import describe, merge
from graphmem.preflight.explain import explain
from graphmem.preflight.formulas import (
    csr_break_even_density,
    csr_bytes,
    int4_weight_bytes,
    int8_weight_bytes,
    offload_scaling,
    scaled_peak,
    zero_scaling,
)
from graphmem.preflight.model_facts import block_classes, model_facts
from graphmem.preflight.plan import rank_rows
from graphmem.preflight.ranking import Departure, departure, effort
from graphmem.preflight.rows import PlanRow, batch_templates
from graphmem.preflight.search import find_largest_fit, fit_line
from graphmem.records import Phase
from tests.conftest import ROOT

MLP = str(ROOT / "examples" / "mlp.py") + ":MLP"


# --- budgets -------------------------------------------------------------------------------

@pytest.mark.parametrize("text, nbytes", [
    ("123456B", 123456), ("512MiB", 512 * 1024**2), ("80GiB", 80 * 1024**3), ("80GB", 80 * 10**9),
    ("1.5KiB", 1536), ("2kb", 2000), (" 7 MB ", 7_000_000), ("1TiB", 1024**4),
])
def test_parse_budget_units(text: str, nbytes: int) -> None:
    assert parse_budget(text).nbytes == nbytes


@pytest.mark.parametrize("text, fraction", [("0.9", Fraction(9, 10)), ("90%", Fraction(9, 10)), ("1", Fraction(1))])
def test_parse_budget_fraction_of_gpu(text: str, fraction: Fraction) -> None:
    assert parse_budget(text).fraction == fraction


@pytest.mark.parametrize("text, fragment", [("80", "has no unit"), ("80G", "unknown unit 'G'"),
                                            ("GiB", "malformed"), ("0B", "zero bytes"), ("-1GiB", "malformed")])
def test_parse_budget_rejects(text: str, fragment: str) -> None:
    with pytest.raises(UserInputError, match=fragment):
        parse_budget(text)


def test_resolve_budget_fraction_of_a_gpu() -> None:
    h100 = get_gpu("h100-80gb")  # 81089 MiB
    budget = resolve_budget(parse_budget("0.9"), h100)
    assert budget.total_bytes == math.floor(81089 * 2**20 * 9 / 10)
    assert resolve_budget(None, h100).total_bytes == 81089 * 2**20
    with pytest.raises(UserInputError, match="no --gpu"):
        resolve_budget(parse_budget("0.9"), None)
    with pytest.raises(UserInputError, match="no budget"):
        resolve_budget(None, None)


def test_margin_and_cap() -> None:
    assert parse_margin("5%") == Fraction(1, 20) == parse_margin("0.05")
    budget = Budget(1050, Fraction(1, 20), "1050B")
    # peak * 1.05 <= 1050  <=>  peak <= 1000
    assert budget.cap_bytes == 1000
    assert budget.fits(1000) and not budget.fits(1001)
    assert budget.required_bytes(1001) == 1052  # ceil(1051.05)
    with pytest.raises(UserInputError):
        parse_margin("150%")


# --- symbolic inputs -----------------------------------------------------------------------

def test_symbolic_inputs() -> None:
    assert input_symbol(["Bx1000"]) == "B"
    assert input_symbol(["ids=Bx128:int64", "mask=Bx128:bool"]) == "B"
    assert input_symbol(["32x1000"]) is None


def test_two_symbols_are_refused() -> None:
    with pytest.raises(UserInputError, match="2 symbolic dimensions"):
        input_symbol(["BxS:int64"])


def test_substitute_keeps_name_and_dtype() -> None:
    assert substitute("ids=Bx128:int64", "B", 7) == "ids=7x128:int64"
    assert substitute("1xSx64", "S", 300) == "1x300x64"
    assert substitute("32X1000", None, 5) == "32x1000"


def test_validate_inputs() -> None:
    assert validate_inputs(["Bx1000", "mask=Bx1000:bool"], symbolic=True) == "B"
    with pytest.raises(UserInputError, match="no symbolic dimension"):
        validate_inputs(["32x1000"], symbolic=True)
    with pytest.raises(UserInputError, match="max-batch"):
        validate_inputs(["Bx1000"], symbolic=False)
    with pytest.raises(UserInputError, match="is not a positive integer"):
        validate_inputs(["bx1000"], symbolic=None)  # lower case is not a symbol


# --- the search ----------------------------------------------------------------------------

def _brute_force(f: Any, cap: int) -> int:
    v = 0
    while f(v + 1) <= cap:
        v += 1
    return v


def test_affine_peak_takes_four_analyses() -> None:
    calls: list[int] = []

    def peak(v: int) -> int:
        calls.append(v)
        return 1000 + 37 * v

    best, seen = find_largest_fit(peak, 5000)
    assert best == 108  # 1000 + 37 * 108 = 4996 <= 5000 < 5033 = 1000 + 37 * 109
    assert sorted(calls) == [1, 2, 108, 109]
    assert seen[108] == 4996 and seen[109] == 5033


@pytest.mark.parametrize("name, f", [
    ("phase change", lambda v: max(1000 + 37 * v, 74 * v)),
    ("quadratic", lambda v: 100 + v * v),
    ("attention", lambda v: 10**6 + 3000 * v + 2 * v * v),
    ("allocator blocks", lambda v: 4096 * math.ceil((100 + v * 37) / 4096)),
    ("flat then rising", lambda v: 5000 if v < 300 else 5000 + (v - 300) * 10),
])
@pytest.mark.parametrize("cap", [123_456, 10**7])
def test_search_is_exact_when_not_affine(name: str, f: Any, cap: int) -> None:
    calls: list[int] = []
    best, _ = find_largest_fit(lambda v: calls.append(v) or f(v), cap)
    assert best == 0 and f(1) > cap or f(best) <= cap < f(best + 1)
    assert len(calls) <= 25, (name, len(calls))
    if cap < 10**6:
        assert best == _brute_force(f, cap)


def test_search_when_nothing_fits_or_only_one() -> None:
    assert find_largest_fit(lambda v: 100 * v, 99) == (0, {1: 100})
    assert find_largest_fit(lambda v: 100 * v, 199)[0] == 1


def test_search_refuses_a_peak_that_does_not_grow() -> None:
    with pytest.raises(UserInputError, match="barely grows"):
        find_largest_fit(lambda v: 100, 1000, limit=1 << 10)


def test_fit_line() -> None:
    slope, intercept, worst = fit_line({1: 110, 2: 120, 10: 200})
    assert (round(slope, 9), round(intercept, 9), round(worst, 9)) == (10.0, 100.0, 0.0)


# --- formulas ------------------------------------------------------------------------------

def _life(sid: int, nbytes: int, start: int, end: int, category: Category) -> Lifetime:
    return Lifetime(sid=sid, nbytes=nbytes, start=start, end=end, category=category)


# op 0 forward, op 1 backward, op 2 optimizer; parameters 800, gradients 800 from op 1, state
# 1600 from op 2, an activation of 300 live in ops 0-1, an optimizer temporary of 400 at op 2.
_LIVES = (_life(0, 800, -1, 2, Category.PARAMETER), _life(1, 800, 1, 2, Category.GRADIENT),
          _life(2, 1600, 2, 2, Category.OPTIMIZER_STATE), _life(3, 300, 0, 1, Category.ACTIVATION),
          _life(4, 400, 2, 2, Category.TEMPORARY))
_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


def test_scaled_peak_by_hand() -> None:
    assert scaled_peak(_LIVES, _PHASES, (0, 0, 0), zero_scaling(1, 1, 0)) == 3600  # unchanged: 800+800+1600+400
    # ZeRO-1 over 4: op 2 = 800 + 800 + 1600/4 + 400/4 = 2100; op 1 = 800 + 800 + 300 = 1900
    assert scaled_peak(_LIVES, _PHASES, (0, 0, 0), zero_scaling(1, 4, 0)) == 2100
    # ZeRO-2 over 4: op 2 = 800 + 200 + 400 + 100 = 1500; op 1 = 800 + 200 + 300 = 1300
    assert scaled_peak(_LIVES, _PHASES, (0, 0, 0), zero_scaling(2, 4, 0)) == 1500
    # ZeRO-3 over 4 with a 100-byte unit: op 1 = 200 + 200 + 300 + 2 x 100 = 900; op 2 = 200+200+400+100 = 900
    assert scaled_peak(_LIVES, _PHASES, (0, 0, 0), zero_scaling(3, 4, 100)) == 900
    # offload: op 2 = 800 + 800; op 1 = 1900
    assert scaled_peak(_LIVES, _PHASES, (0, 0, 0), offload_scaling()) == 1900
    # scratch counts as temporaries: 50 bytes at op 1 -> 1950 with offload
    assert scaled_peak(_LIVES, _PHASES, (0, 50, 0), offload_scaling()) == 1950


def test_weight_formulas_by_hand() -> None:
    assert int8_weight_bytes(500, 1000) == 500_000 + 500 * 2
    # 500 rows x ceil(1000 / 128) = 8 groups x (2-byte scale + 2-byte zero)
    assert int4_weight_bytes(500, 1000) == 250_000 + 500 * 8 * 4
    # half of 100 x 10 kept: 500 x (4 + 8) values and column indices + 101 row pointers x 8
    assert csr_bytes(100, 10, Fraction(1, 2), 4) == 500 * 12 + 101 * 8
    assert csr_break_even_density(4) == Fraction(1, 3)


def _row(name: str, fits: bool, extra: float, effort: int, peak: int, departure: int = 0) -> PlanRow:
    return PlanRow(name=name, changes={}, peak_bytes=peak, saving_bytes=0, extra_compute=extra, fits=fits,
                   source="analysis", effort=effort, departure=departure)


def test_rank_rows_fitting_then_kept_math_then_effort_then_compute() -> None:
    rows = [_row("no fit", False, 0.0, 0, 1), _row("recompute", True, 0.2, 0, 5),
            _row("zero", True, 0.0, 2, 3), _row("flag", True, 0.0, 0, 9), _row("flag small", True, 0.0, 0, 4),
            _row("sgd", True, 0.0, 0, 2, Departure.OTHER_OPTIMIZER),
            _row("8-bit", True, 0.0, 0, 2, Departure.QUANTIZED_STATE),
            _row("autocast", True, 0.0, 0, 2, Departure.MIXED_PRECISION)]
    # fitting rows that keep the math (mixed precision included): settings before more hardware,
    # free before recomputation, the same math before mixed precision among equals, the smallest
    # change first; then the rows that depart, the nearest first: 8-bit state before another optimizer
    assert [r.name for r in rank_rows(rows)] == ["flag", "flag small", "autocast", "recompute", "zero", "8-bit",
                                                 "sgd", "no fit"]


@pytest.mark.parametrize("changes, optimizer, expected", [
    ({"optimizer": "adamw8bit"}, "adamw", Departure.QUANTIZED_STATE),
    ({"optimizer": "adamw8bit"}, "sgd-momentum", Departure.OTHER_OPTIMIZER),
    ({"optimizer": "sgd"}, "adamw", Departure.OTHER_OPTIMIZER),
    ({"master_weights": "bfloat16"}, "adamw", Departure.MIXED_PRECISION),
    ({"dtype": "bfloat16"}, "adamw", Departure.HALF_PRECISION),
    ({"batch": 8, "grad_accum": 4}, "adamw", Departure.SAME_MATH),
    ({"batch": 8}, "adamw", Departure.SMALLER_BATCH),
    ({"optimizer_impl": "fused", "checkpoint": ["Block"], "offload": "optimizer"}, "adamw", Departure.SAME_MATH),
    ({"optimizer_impl": "fused", "dtype": "bfloat16"}, "adamw", Departure.HALF_PRECISION),
])
def test_departure_of_changes(changes: dict[str, Any], optimizer: str, expected: Departure) -> None:
    assert departure(changes, "train", optimizer) == expected


def test_accumulation_with_batch_norm_departs() -> None:
    assert departure({"batch": 8, "grad_accum": 4}, "train", "sgd", batch_norm=True) == Departure.MICRO_BATCH_NORM


def test_combinations_are_named_for_what_they_are() -> None:
    # another optimizer replaces the implementation of the job's own: "fused Adam + SGD" is just SGD
    assert merge({"optimizer_impl": "fused"}, {"optimizer": "sgd"}) == {"optimizer": "sgd"}
    assert describe({"optimizer": "sgd"}, "adam") == "SGD (no optimizer state)"
    assert describe({"optimizer_impl": "fused"}, "adamw") == "fused AdamW (fused=True)"
    both = merge({"optimizer_impl": "fused", "checkpoint": ["Block"]}, {"dtype": "bfloat16"})
    assert both is not None
    assert describe(both, "adamw") == ("fused AdamW (fused=True) + bf16 weights and optimizer state (no fp32 copy) "
                                       "+ checkpoint every Block")
    # the step moves to the host: no device implementation, and no bitsandbytes optimizer there
    assert merge({"optimizer_impl": "fused"}, {"offload": "optimizer"}) == {"offload": "optimizer"}
    assert merge({"optimizer": "adamw8bit"}, {"offload": "optimizer"}) is None
    assert merge({"optimizer": "adamw8bit"}, {"master_weights": "bfloat16"}) is None
    assert describe({"parallel": "fsdp=4"}, "adamw", device="cpu") == "FSDP2 over 4 processes (ZeRO-3)"


def test_effort_of_changes() -> None:
    assert effort({"checkpoint": ["Block"], "optimizer_impl": "fused"}) == 0
    assert effort({"dtype": "bfloat16"}) == 1
    assert effort({"checkpoint": ["Block"], "offload": "optimizer"}) == 2


# --- model structure -----------------------------------------------------------------------

class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)) for _ in range(2))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_model_facts_by_hand() -> None:
    facts = model_facts(_Tied)
    assert block_classes(_Tied()) == ("Sequential",)
    # the tied head is left out of the quantizable Linear weights
    assert facts.linear_weights == ((8, 4, 4), (4, 8, 4), (8, 4, 4), (4, 8, 4))
    # emb 40 + per block (32 + 8 + 32 + 4) x 2 = 192 elements, each storage once, 4 bytes
    assert facts.params_bytes == 192 * 4
    assert facts.unit_bytes == 76 * 4
    assert model_facts(_Tied, dtype=torch.bfloat16).params_bytes == 192 * 2


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))


def test_block_classes_outermost_first() -> None:
    model = nn.Sequential(nn.ModuleList(_Layer() for _ in range(2)), nn.BatchNorm1d(4))
    # the decoder layer before the attention inside it; nn.Sequential (the MLPs) last
    assert block_classes(model) == ("_Layer", "_Attention", "Sequential")
    assert model_facts(lambda: model).batch_norm and not model_facts(_Tied).batch_norm


def test_batch_templates() -> None:
    assert batch_templates(["ids=8x128:int64", "8x128:bool", "3x4"]) == \
        (8, ("ids=Bx128:int64", "Bx128:bool", "3x4:float32"))


def test_explain_without_both_modes_is_short() -> None:
    assert explain(None, None, 0, 0) == ""


# --- CLI -----------------------------------------------------------------------------------

def run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def test_check_exit_codes() -> None:
    fits = run("check", MLP, "--input", "4x1000", "--budget", "1GiB")
    assert fits.exit_code == 0, fits.output
    assert "FITS" in fits.output
    short = run("check", MLP, "--input", "4x1000", "--budget", "1MiB")
    assert short.exit_code == 1 and "DOES NOT FIT" in short.output
    assert run("check", MLP, "--input", "4x1000", "--budget", "80").exit_code == 2
    assert run("check", MLP, "--input", "Bx1000", "--budget", "1GiB").exit_code == 2
    assert run("check", MLP, "--input", "4x1000").exit_code == 2  # no budget, no --gpu
    failed = run("check", MLP, "--input", "4x1000", "--budget", "1GiB", "--optimizer", "lbfgs")
    assert failed.exit_code == 3 and "LBFGS" in failed.output


def test_check_maps_bugs_to_3_not_1(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("graphmem.cli.preflight_commands.check", broken)
    result = run("check", MLP, "--input", "4x1000", "--budget", "1GiB")
    assert result.exit_code == 3 and "internal error: RuntimeError: boom" in result.output


def test_check_json_with_margin() -> None:
    result = run("check", MLP, "--input", "4x1000", "--budget", "1GiB", "--margin", "5%", "--format", "json")
    data = json.loads(result.output)
    assert data["fits"] is True and data["metric"] == "peak_bytes"
    assert data["required_bytes"] == math.ceil(data["peak_bytes"] * 105 / 100)
    assert data["headroom_bytes"] == 2**30 - data["required_bytes"]


def test_check_on_a_gpu_compares_the_reserved_peak_and_the_context() -> None:
    data = json.loads(run("check", MLP, "--input", "4x1000", "--gpu", "t4", "--budget", "0.5",
                          "--format", "json").output)
    assert data["device"] == "cuda" and data["metric"] == "reserved_peak_bytes"
    assert data["budget_bytes"] == 15095 * 2**20 // 2
    assert data["reserved_peak_bytes"] >= data["peak_bytes"] == data["allocated_peak_bytes"]
    # what the GPU must hold: the allocator's segments + the CUDA context (300 MiB on a Turing T4)
    assert data["compared_bytes"] == data["reserved_peak_bytes"] + 300 * 2**20 == data["required_bytes"]


def test_max_batch_and_max_seq_keys() -> None:
    batch = run("max-batch", MLP, "--input", "Bx1000", "--budget", "16MiB", "--format", "json")
    assert batch.exit_code == 0, batch.output
    data = json.loads(batch.output)
    assert data["peak_bytes_at_max"] <= 16 * 2**20 < data["peak_bytes_at_next"]
    assert data["analyses"] <= 10 and data["bytes_per_sample"] > 0
    gpt = str(ROOT / "examples" / "gpt.py") + ":GPT"
    seq = run("max-seq", gpt, "--input", "1xS:int64", "--loss", "cross_entropy", "--budget", "8MiB",
              "--kwargs", '{"vocab": 100, "dim": 32, "layers": 1, "heads": 2, "max_seq": 4096}', "--format", "json")
    assert seq.exit_code == 0, seq.output
    data = json.loads(seq.output)
    assert data["max_seq"] > 1 and data["peak_bytes_at_max"] <= 8 * 2**20 < data["peak_bytes_at_next"]
    assert "bytes_per_token" in data
    assert run("max-batch", MLP, "--input", "32x1000", "--budget", "16MiB").exit_code == 2
    assert run("max-batch", MLP, "--input", "Bx1000", "--budget", "1KiB").exit_code == 1
