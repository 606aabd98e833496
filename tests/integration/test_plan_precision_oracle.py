"""The plan's precision and offload rows against real CPU execution, and the KV-cache rows by
hand arithmetic.

Mixed precision as trainers hold it (bf16 weights, fp32 master weights and optimizer state) is
run here with its own procedure, written from the paper and apex / DeepSpeed, not with
graphmem's optimizer: the plan's row must equal the live bytes of that real run to the byte.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any

import pytest
import torch
from torch import nn

from graphmem import analyze, make_job
from graphmem.job.job import edited
from graphmem.preflight.budget import Budget
from graphmem.preflight.master_weights import MASTER_WEIGHTS_OPTIMIZER
from graphmem.preflight.plan import Plan, make_plan
from graphmem.preflight.rows import PlanRow
from tests.models import ZOO
from tests.optional import installed
from tests.oracles import measure_training, real_inputs

MODELS = {m.name: m for m in ZOO}
_SPECS = {"mlp": "32x1000", "gpt": "4x16:int64"}


class Fp32MasterAdamW(torch.optim.Optimizer):
    """Micikevicius et al. 2018, section 3.1: AdamW over fp32 copies of the bf16 weights.  At the
    step every bf16 gradient becomes the fp32 gradient of its copy and is dropped; AdamW updates
    the copies; their gradients are dropped and the copies written back to the weights."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.low = list(params)
        self.high = [p.detach().clone().float().requires_grad_() for p in self.low]
        self.adamw = torch.optim.AdamW(self.high)
        super().__init__(self.low, {})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for low, high in zip(self.low, self.high):
            high.grad = low.grad.float()
            low.grad = None
        self.adamw.step()
        for low, high in zip(self.low, self.high):
            high.grad = None
            low.copy_(high)


class HandOff(torch.optim.Optimizer):
    """The device side of an offloaded optimizer: the gradients leave at the step."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        super().__init__(list(params), {})

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


@functools.cache
def _plan(name: str) -> tuple[Plan, int]:
    """The plan of the Adam step at 60% of the analysed baseline (nothing of its own math fits)."""
    model = MODELS[name]
    job = make_job(model.build, (_SPECS[name],), mode="train", loss=model.loss, optimizer="adam")
    base = measure_training(model.build, _inputs(name), torch.optim.Adam, model.loss).peak_bytes
    return make_plan(job, Budget(int(base * 0.6), Fraction(0), "test")), base


def _row(plan: Plan, changes: dict[str, Any]) -> PlanRow:
    return next(r for r in plan.rows if dict(r.changes) == changes)


def _bf16(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    return lambda: build().to(torch.bfloat16)


def _inputs(name: str, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    tensors = real_inputs([_SPECS[name]], MODELS[name].int_high)
    return [t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in tensors]


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_master_weights_are_the_real_mixed_precision_step(name: str) -> None:
    """What the row analyses (the bf16 model, graphmem's master-weights optimizer over AdamW)
    equals the independent procedure run for real, to the byte."""
    model = MODELS[name]
    spec = _SPECS[name] if ":" in _SPECS[name] else _SPECS[name] + ":bfloat16"
    job = make_job(model.build, (spec,), mode="train", loss=model.loss, dtype="bfloat16",
                   optimizer=MASTER_WEIGHTS_OPTIMIZER, optimizer_kwargs={"inner": "adamw"})
    report = analyze(job).train
    real = measure_training(_bf16(model.build), _inputs(name, torch.bfloat16), Fp32MasterAdamW, model.loss)
    assert report is not None and report.peak_bytes == real.peak_bytes


def test_precision_rows_are_the_real_steps() -> None:
    model = MODELS["mlp"]
    plan, _ = _plan("mlp")
    master = _row(plan, {"master_weights": "bfloat16"})
    real = measure_training(_bf16(model.build), _inputs("mlp", torch.bfloat16), Fp32MasterAdamW, model.loss)
    assert (master.peak_bytes, master.source) == (real.peak_bytes, "analysis")
    assert master.name == "bf16 weights + fp32 master weights and optimizer state"
    # the job's Adam over the bf16 weights themselves: no fp32 copy
    pure = _row(plan, {"dtype": "bfloat16"})
    real = measure_training(_bf16(model.build), _inputs("mlp", torch.bfloat16), torch.optim.Adam, model.loss)
    assert pure.peak_bytes == real.peak_bytes


def test_master_weights_hold_what_mixed_precision_holds() -> None:
    """Independent sums: bf16 weights (2 B) + fp32 master (4 B) + AdamW's two fp32 states (8 B)
    per parameter are live after the step (each storage counted once)."""
    plan, _ = _plan("mlp")
    row = _row(plan, {"master_weights": "bfloat16"})
    params = sum(p.numel() for p in MODELS["mlp"].build().parameters())
    assert row.peak_bytes > params * (2 + 4 + 8)


@pytest.mark.slow
def test_offload_row_is_the_device_side_of_the_step() -> None:
    """The row analyses forward and backward with the gradients handed off at the step
    (optimizer "none"): on CPU that analysis equals a real run with a hand-off optimizer; on
    the CUDA target (the only one offered the row) the row is that analysis's reserved peak with
    the CUDA context (what the GPU must hold, as every plan row on cuda)."""
    model = MODELS["mlp"]
    real = measure_training(model.build, _inputs("mlp"), HandOff, model.loss).peak_bytes
    cpu = analyze(make_job(model.build, (_SPECS["mlp"],), mode="train", loss=model.loss, optimizer="none")).train
    assert cpu is not None and cpu.peak_bytes == real
    # on the GPU the GPT (the MLP's step changes no reserved segment: a row saving nothing is left out)
    gpt = MODELS["gpt"]
    job = make_job(gpt.build, (_SPECS["gpt"],), mode="train", loss=gpt.loss, optimizer="adam", gpu="h100-80gb")
    plan = make_plan(job, Budget(1 << 20, Fraction(0), "test"), world_size=1)
    cuda = analyze(edited(job, optimizer="none")).train
    assert cuda is not None and cuda.allocator is not None
    hopper_context = 500 << 20  # graphmem/cuda/gpus.py, CUDA_CONTEXT_BYTES
    assert _row(plan, {"offload": "optimizer"}).peak_bytes == cuda.allocator.reserved_peak_bytes + hopper_context
    assert not [r for r in plan.rows if "parallel" in r.changes]  # one GPU: no sharding rows
    cpu_plan = make_plan(edited(job, device="cpu"), Budget(1 << 20, Fraction(0), "test"))
    assert not [r for r in cpu_plan.rows if "offload" in r.changes]  # the CPU target is the host


LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def _llama() -> nn.Module:
    T = installed("transformers")
    config = T.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                           num_attention_heads=4, num_key_value_heads=KV_HEADS)
    return T.LlamaForCausalLM(config)


def test_kv_cache_rows_by_hand() -> None:
    installed("transformers")  # imported before graphmem builds the model
    job = make_job(_llama, (), generate="16+8", batch=2)
    plan = make_plan(job, Budget(1 << 10, Fraction(0), "test"))
    # the prefill and decode peaks (equal to real execution: tests/integration/test_generate.py)
    report = analyze(job).generate
    assert report is not None
    # K and V, per layer, kv heads x head dim, fp32, 2 sequences: 24 tokens at the last decode
    # step, the prompt's 16 in the prefill
    kv, kv_prompt = (2 * LAYERS * KV_HEADS * HEAD_DIM * 4 * tokens * 2 for tokens in (24, 16))
    for name, size in (("float8", 1), ("bfloat16", 2)):
        row = _row(plan, {"kv_cache": name})
        expected = max(report.prefill_peak_bytes - kv_prompt + kv_prompt * size // 4,
                       report.decode_peak_bytes - kv + kv * size // 4)
        assert (row.peak_bytes, row.source) == (expected, "formula"), name
    assert _row(plan, {"kv_cache": "float8"}).name == "KV cache in fp8"
