"""Issue 6 against real execution on CPU: ``check``'s exit codes around a measured peak,
``max-batch``'s answer run for real at N and N+1, and every plan row that changes execution
run for real with the same settings."""

from __future__ import annotations

import functools
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.nn.utils import prune

from graphmem.cli import main
from graphmem.job import make_job
from graphmem.preflight.budget import Budget
from graphmem.preflight.plan import Plan, make_plan
from graphmem.preflight.search import search_largest
from tests.models import ZOO, ZooModel
from tests.oracles import OPTIMIZERS, measure_inference, measure_training, real_inputs

MODELS = {m.name: m for m in ZOO}
EXECUTED = {"batch", "checkpoint", "amp", "optimizer", "grad_accum", "dtype"}
_AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _with_batch(spec: str, batch: int) -> str:
    return f"{batch}x{spec.split('x', 1)[1]}"


def _measure_train(model: ZooModel, specs: list[str], optimizer: str = "adam", **options: Any) -> int:
    return measure_training(model.build, real_inputs(specs, model.int_high), OPTIMIZERS[optimizer], model.loss,
                            **options).peak_bytes


def _oracle_for_row(model: ZooModel, spec: str, changes: dict[str, Any], mode: str) -> int:
    """Run the row's settings for real: the same batch, optimizer, autocast, checkpointing, accumulation."""
    batch = changes.get("batch", int(spec.split("x")[0]))
    specs = [_with_batch(spec, batch)]
    if mode == "inference":
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(changes.get("dtype", ""))
        build: Callable[[], nn.Module] = (lambda: model.build().to(dtype)) if dtype else model.build
        if "amp" in changes:
            build = _autocast(model.build, _AMP[changes["amp"]])
        inputs = [t.to(dtype) if dtype and t.is_floating_point() else t for t in real_inputs(specs, model.int_high)]
        return measure_inference(build, inputs).peak_bytes
    options: dict[str, Any] = {"grad_accum": changes.get("grad_accum", 1),
                               "checkpoint_classes": tuple(changes.get("checkpoint", ()))}
    if "amp" in changes:
        options["amp"] = _AMP[changes["amp"]]
    if "dtype" in changes:  # training with the weights (and so the optimizer state) in bf16
        half = {"bfloat16": torch.bfloat16, "float16": torch.float16}[changes["dtype"]]
        inputs = [t.to(half) if t.is_floating_point() else t for t in real_inputs(specs, model.int_high)]
        return measure_training(lambda: model.build().to(half), inputs, OPTIMIZERS[changes.get("optimizer", "adam")],
                                model.loss, **options).peak_bytes
    return _measure_train(model, specs, changes.get("optimizer", "adam"), **options)


def _autocast(build: Callable[[], nn.Module], dtype: torch.dtype) -> Callable[[], nn.Module]:
    """The model called under torch.autocast("cpu", dtype), as an inference script would."""

    class Autocast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = build()

        def forward(self, *args: Any) -> Any:
            with torch.autocast("cpu", dtype=dtype):
                return self.inner(*args)

    return Autocast


# --- check -------------------------------------------------------------------------------

@pytest.mark.parametrize("name, mode", [("mlp", "train"), ("gpt", "train"), ("simplenet", "inference")])
def test_check_exit_codes_five_percent_around_the_measured_peak(name: str, mode: str) -> None:
    model = MODELS[name]
    if mode == "train":
        measured = _measure_train(model, list(model.inputs))
    else:
        measured = measure_inference(model.build, real_inputs(model.inputs, model.int_high)).peak_bytes
    args = ["--input", *model.inputs, "--loss", model.loss, "--mode", mode]
    runner = CliRunner()
    above = runner.invoke(main, ["check", _target(name), *args, "--budget", f"{int(measured * 1.05)}B"])
    below = runner.invoke(main, ["check", _target(name), *args, "--budget", f"{int(measured * 0.95)}B"])
    assert above.exit_code == 0, above.output
    assert below.exit_code == 1, below.output
    # the margin counts too: 5% above the peak with a 10% margin does not fit
    margin = runner.invoke(main, ["check", _target(name), *args, "--budget", f"{int(measured * 1.05)}B",
                                  "--margin", "10%"])
    assert margin.exit_code == 1, margin.output


def _target(name: str) -> str:
    return f"tests.integration.test_preflight_oracle:build_{name}"


def build_mlp() -> nn.Module:
    return MODELS["mlp"].build()


def build_gpt() -> nn.Module:
    return MODELS["gpt"].build()


def build_simplenet() -> nn.Module:
    return MODELS["simplenet"].build()


# --- max-batch ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, template", [("mlp", "Bx1000"), ("simplenet", "Bx1x28x28"),
                                            pytest.param("gpt", "Bx16:int64", marks=pytest.mark.slow)])
def test_max_batch_fits_for_real_at_n_and_not_at_n_plus_1(name: str, template: str) -> None:
    model = MODELS[name]
    at = {b: _measure_train(model, [template.replace("B", str(b))]) for b in (9, 10)}
    budget = Budget((at[9] + at[10]) // 2, Fraction(0), "between the measured peaks at 9 and 10")
    result = search_largest(make_job(model.build, (template,), mode="train", loss=model.loss), budget)
    n = result.max_value
    real_n, real_next = (at[b] if b in at else _measure_train(model, [template.replace("B", str(b))])
                         for b in (n, n + 1))
    assert real_n <= budget.total_bytes < real_next, (n, real_n, real_next, budget.total_bytes)
    assert n == 9
    assert (result.peak_bytes_at_max, result.peak_bytes_at_next) == (real_n, real_next)
    assert len(result.evaluated) <= 10


# --- plan --------------------------------------------------------------------------------

@functools.cache
def _plan(name: str, spec: str, mode: str, share: float) -> tuple[Plan, int]:
    """The plan at ``share`` of the measured baseline peak (cached: several tests read it)."""
    model = MODELS[name]
    job = make_job(model.build, (spec,), mode=mode, loss=model.loss, optimizer="adam")
    if mode == "train":
        base = _measure_train(model, [spec])
    else:
        base = measure_inference(model.build, real_inputs([spec], model.int_high)).peak_bytes
    return make_plan(job, Budget(int(base * share), Fraction(0), "test")), base


@pytest.mark.parametrize("name, spec, mode, share, kinds, combined", [
    ("mlp", "32x1000", "train", 0.6, {"batch", "amp", "optimizer", "grad_accum", "dtype"}, False),
    # 45%: no remedy fits alone, so the plan combines them (SGD + bf16 + checkpointing, ...)
    pytest.param("gpt", "4x16:int64", "train", 0.45, {"batch", "amp", "optimizer", "grad_accum", "checkpoint"}, True,
                 marks=pytest.mark.slow),
    ("mlp", "32x1000", "inference", 0.6, {"batch", "amp", "dtype"}, False),
])
def test_every_executed_plan_row_matches_real_execution(name: str, spec: str, mode: str, share: float,
                                                        kinds: set[str], combined: bool) -> None:
    model = MODELS[name]
    plan, base = _plan(name, spec, mode, share)
    assert plan.baseline.peak_bytes == base and not plan.baseline.fits
    checked: set[str] = set()
    combinations = 0
    for row in plan.rows:
        if row.source != "analysis" or not set(row.changes) <= EXECUTED or not row.changes:
            continue
        measured = _oracle_for_row(model, spec, dict(row.changes), mode)
        assert abs(row.peak_bytes - measured) <= 0.01 * measured, (row.name, row.peak_bytes, measured)
        checked |= set(row.changes)
        combinations += len(set(row.changes) - {"batch"}) > 1
    assert kinds <= checked
    assert (combinations > 0) == combined


def test_pruning_adds_memory_as_predicted() -> None:
    """torch.nn.utils.prune keeps weight_orig and a mask: the Chinese seed's 'pruning saves
    memory' is false until the weights are made sparse or the layer shrinks."""
    model = MODELS["mlp"]
    plan, base = _plan("mlp", "32x1000", "train", 0.6)
    row = next(r for r in plan.rows if r.changes == {"prune_amount": 0.5})

    def pruned() -> nn.Module:
        net = model.build()
        for layer in net.modules():
            if isinstance(layer, nn.Linear):
                prune.l1_unstructured(layer, "weight", amount=0.5)
        return net

    measured = measure_training(pruned, real_inputs(["32x1000"], 100), OPTIMIZERS["adam"], "sum").peak_bytes
    assert row.peak_bytes == measured
    assert measured > base and row.saving_bytes < 0


def test_quantization_rows_by_independent_sums() -> None:
    model = MODELS["mlp"]
    plan, base = _plan("mlp", "32x1000", "inference", 0.6)
    weights = [m.weight for m in model.build().modules() if isinstance(m, nn.Linear)]
    dense = sum(w.numel() * 4 for w in weights)
    int8 = sum(w.numel() + w.shape[0] * 2 for w in weights)
    row = next(r for r in plan.rows if r.changes == {"quantize": "int8"})
    assert row.peak_bytes == base - dense + int8 and row.source == "formula"


def test_explanation_states_the_measured_ratio() -> None:
    model = MODELS["mlp"]
    plan, train = _plan("mlp", "32x1000", "train", 0.6)
    inference = measure_inference(model.build, real_inputs(["32x1000"], 100)).peak_bytes
    assert f"Training takes {train / inference:.2f}x the memory of inference" in plan.explanation
    assert "5-9x" in plan.explanation
