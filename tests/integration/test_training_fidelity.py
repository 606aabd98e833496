"""Issue 3's features against real execution on CPU: every optimizer and implementation,
autocast, GradScaler, activation checkpointing, gradient accumulation."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import graphmem
from graphmem.errors import UnsupportedError, UserInputError
from graphmem.job.optim_formula import eight_bit_state_bytes
from graphmem.job.step import OPTIMIZERS
from tests.models import ZOO, ZooModel
from tests.oracles import measure_training, real_inputs

MODELS = {m.name: m for m in ZOO}
RECORDABLE = [name for name, (cls, _) in OPTIMIZERS.items() if cls != "LBFGS"]


def _impls(name: str) -> list[str]:
    cls = getattr(torch.optim, OPTIMIZERS[name][0])
    accepted = inspect.signature(cls.__init__).parameters
    return ["for-loop", "foreach"] + (["fused"] if "fused" in accepted else [])


def _oracle_optimizer(name: str, impl: str) -> Any:
    cls_name, defaults = OPTIMIZERS[name]
    flags = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    return lambda params: getattr(torch.optim, cls_name)(params, **defaults, **flags)


def _check(model: ZooModel, oracle_optimizer: Any, **options: Any) -> None:
    oracle_options = {k: v for k, v in options.items() if k in ("grad_accum",)}
    if options.get("amp"):
        oracle_options["amp"] = {"bf16": torch.bfloat16, "fp16": torch.float16}[options["amp"]]
    if options.get("checkpoint"):
        oracle_options["checkpoint_classes"] = tuple(options["checkpoint"])
        oracle_options["checkpoint_every"] = options.get("checkpoint_every", 1)
        oracle_options["checkpoint_save"] = tuple(options.get("checkpoint_save", ()))
    measured = measure_training(model.build, real_inputs(model.inputs, model.int_high), oracle_optimizer,
                                model.loss, **oracle_options)
    predicted = graphmem.analyze(model.build, model.inputs, mode="train", loss=model.loss, **options)
    assert predicted.train is not None
    assert predicted.train.peak_bytes == measured.peak_bytes
    assert {p.phase: p.peak_bytes for p in predicted.train.phases} == measured.phase_peaks


@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize("optimizer, impl", [(o, i) for o in RECORDABLE for i in _impls(o)])
def test_every_optimizer_and_implementation(model: str, optimizer: str, impl: str) -> None:
    _check(MODELS[model], _oracle_optimizer(optimizer, impl), optimizer=optimizer, optimizer_impl=impl)


@pytest.mark.parametrize("model", ["gpt", "resnet", "mlp"])
def test_autocast_bf16(model: str) -> None:
    _check(MODELS[model], _oracle_optimizer("adamw", "for-loop"), optimizer="adamw", amp="bf16")


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_autocast_fp16_with_grad_scaler(model: str) -> None:
    _check(MODELS[model], _oracle_optimizer("adam", "for-loop"), optimizer="adam", amp="fp16")


def test_checkpoint_what_if_on_gpt_blocks() -> None:
    _check(MODELS["gpt"], _oracle_optimizer("sgd", "for-loop"), optimizer="sgd", checkpoint=["Block"])


@pytest.mark.parametrize("options", [
    {"checkpoint_every": 2}, {"checkpoint_save": ["matmuls"]}, {"checkpoint_save": ["every-2nd-matmul"]},
    {"checkpoint_save": ["attention"]}, {"checkpoint_save": ["aten.mm", "aten.addmm"], "checkpoint_every": 2},
])
def test_selective_and_every_kth_block_checkpointing(options: dict[str, Any]) -> None:
    model = ZooModel("gpt4", lambda: MODELS["gpt"].build().__class__(vocab=100, dim=64, layers=4, heads=4,
                                                                     max_seq=64), ("8x32:int64",),
                     loss="cross_entropy")
    _check(model, _oracle_optimizer("sgd", "for-loop"), optimizer="sgd", checkpoint=["Block"], **options)


def test_checkpoint_report_has_both_numbers_and_recompute_flops() -> None:
    model = MODELS["gpt"]
    report = graphmem.analyze(model.build, model.inputs, mode="train", loss=model.loss, checkpoint=["Block"])
    assert report.train is not None and report.train_without_checkpoint is not None
    assert report.train.recompute_flops > 0
    assert report.train_without_checkpoint.recompute_flops == 0
    # recomputing the blocks' forward costs exactly the FLOPs the baseline adds less backward:
    assert report.train.flops == report.train_without_checkpoint.flops + report.train.recompute_flops


@pytest.mark.parametrize("accum", [2, 4])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_gradient_accumulation(model: str, accum: int) -> None:
    _check(MODELS[model], _oracle_optimizer("adam", "for-loop"), optimizer="adam", grad_accum=accum)


def test_steady_state_and_first_step_are_both_reported() -> None:
    model = MODELS["mlp"]
    report = graphmem.analyze(model.build, model.inputs, mode="train", loss=model.loss, optimizer="adam")
    assert report.train is not None
    assert len(report.train.iteration_peaks) == 2
    assert max(report.train.iteration_peaks) == report.train.peak_bytes


def test_eight_bit_state_formula_by_hand() -> None:
    # 1000x500 weight: 2 states x (500000 B + 4 B x ceil(500000 / 256) = 1954 blocks)
    assert eight_bit_state_bytes(500_000, 2) == 2 * (500_000 + 4 * 1954)
    # below min_8bit_size (4096 elements) state stays 32-bit: 2 x 4 B x 500
    assert eight_bit_state_bytes(500, 2) == 4000
    report = graphmem.analyze(MODELS["mlp"].build, ["4x1000"], mode="train", optimizer="adam8bit")
    assert report.train is not None
    # MLP: 1000x500 + 500 + 500x100 + 100 elements
    expected = sum(eight_bit_state_bytes(n, 2) for n in (500_000, 500, 50_000, 100))
    assert report.train.optimizer_state_bytes == expected


def test_custom_optimizer_class(make_module: Any) -> None:
    name = make_module("""
        import torch
        class Lion(torch.optim.Optimizer):
            def __init__(self, params, lr=1e-4):
                super().__init__(params, {"lr": lr})
            @torch.no_grad()
            def step(self, closure=None):
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is None:
                            continue
                        state = self.state[p]
                        if not state:
                            state["exp_avg"] = torch.zeros_like(p)
                        update = state["exp_avg"].lerp(p.grad, 0.1).sign_()
                        p.add_(update, alpha=-group["lr"])
                        state["exp_avg"].lerp_(p.grad, 0.01)
    """)
    model = MODELS["mlp"]
    report = graphmem.analyze(model.build, model.inputs, mode="train", optimizer=f"{name}:Lion")
    assert report.train is not None
    params = sum(p.numel() * 4 for p in model.build().parameters())
    assert report.train.optimizer_state_bytes == params  # one exp_avg per parameter


def test_lbfgs_is_refused_clearly() -> None:
    with pytest.raises(UnsupportedError, match="LBFGS cannot be recorded"):
        graphmem.analyze(MODELS["mlp"].build, ["2x1000"], mode="train", optimizer="lbfgs")


def test_fused_where_unsupported_is_a_usage_error() -> None:
    with pytest.raises(UserInputError, match="no fused implementation"):
        graphmem.analyze(MODELS["mlp"].build, ["2x1000"], mode="train", optimizer="rmsprop",
                         optimizer_impl="fused")
