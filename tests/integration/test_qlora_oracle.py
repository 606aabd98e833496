"""QLoRA (--lora with --quantize-base) against real CPU execution, to the byte, per phase too.

The reference is what a QLoRA script does, never through graphmem: a small Llama saved to a
temporary directory, loaded back by ``from_pretrained`` with a ``BitsAndBytesConfig`` on the
CPU (bitsandbytes quantizes every loaded weight for real), then peft's ``get_peft_model``.
The quantization state of each 4-bit weight (its scales and code book, Python attributes of
the weight) is counted from the start, like the weights.  bitsandbytes' fused inference
kernel for AVX512-BF16 CPUs (it repacks the weights) is turned off in the reference, as
graphmem models the path a GPU takes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import graphmem
from tests.optional import installed
from tests.oracles import OPTIMIZERS, measure_inference, measure_training


def _packages() -> tuple[ModuleType, ModuleType, ModuleType]:
    """transformers, peft and bitsandbytes, imported (the test skipped where one is missing)."""
    transformers, peft = installed("transformers"), installed("peft")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its note on optional CPU kernels
    return transformers, peft, installed("bitsandbytes")


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """Every test needs all three: imported before anything is measured (their import-time
    tensors count in nothing)."""
    _packages()


CONFIG: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=128, bos_token_id=0, eos_token_id=0)
IDS = "input_ids=2x16:int64"
LORA = "r=8,alpha=16,target=q_proj,v_proj"
# each --quantize-base kind as a QLoRA script writes its BitsAndBytesConfig
KINDS: dict[str, dict[str, Any]] = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16),
    "nf4-dq": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                   bnb_4bit_compute_dtype=torch.bfloat16),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.bfloat16),
    "int8": dict(load_in_8bit=True),  # LLM.int8, threshold 6.0
}


def _save(path: Path, config: dict[str, Any]) -> Path:
    transformers, _, _ = _packages()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 Llama checkpoint on disk (random weights, made here: nothing is downloaded)."""
    return _save(tmp_path_factory.mktemp("llama"), CONFIG)


def _qlora(path: Path, kind: str, config: dict[str, Any] = CONFIG, norm_scale: float = 1.0
           ) -> Callable[[], torch.nn.Module]:
    """norm_scale: every RMSNorm weight multiplied by it after loading (large ones make LLM.int8's
    outlier columns: activations past its threshold)."""

    transformers, peft, bnb = _packages()

    def build() -> torch.nn.Module:
        config = transformers.BitsAndBytesConfig(**KINDS[kind])
        model = transformers.LlamaForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu",
                                                              dtype=torch.bfloat16)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.mul_(norm_scale)
        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        wrapped: torch.nn.Module = peft.get_peft_model(model, lora)
        for layer in wrapped.modules():
            if isinstance(layer, bnb.nn.Linear4bit):
                layer.support_avx512bf16_for_cpu = False
        return wrapped
    return build


def _quantization_state(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor in the 4-bit weights' QuantState (and its nested state), and the int8
    weights' row scales (SCB; the int8 weight CB is the parameter's own storage)."""
    _, _, bnb = _packages()
    found: list[torch.Tensor] = []

    def walk(value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif depth < 3 and hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
            for item in vars(value).values():
                walk(item, depth + 1)

    for param in model.parameters():
        if isinstance(param, bnb.nn.Params4bit):
            walk(param.quant_state, 0)
        if isinstance(param, bnb.nn.Int8Params) and param.SCB is not None:
            found.append(param.SCB)
    return found


def _ids() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, CONFIG["vocab_size"], (2, 16))


@pytest.mark.parametrize("kind", list(KINDS))
def test_qlora_training_matches_real_execution(checkpoint: Path, kind: str) -> None:
    ids = _ids()
    measured = measure_training(_qlora(checkpoint, kind), [], OPTIMIZERS["adamw"], "auto",
                                kw_inputs={"input_ids": ids, "labels": ids.clone()}, also_held=_quantization_state)
    report = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], hf_config=CONFIG, mode="train",
                              optimizer="adamw", dtype="bf16", lora=LORA, quantize_base=kind)
    assert report.train is not None
    assert report.train.peak_bytes == measured.peak_bytes
    assert {p.phase: p.peak_bytes for p in report.train.phases} == measured.phase_peaks
    model = _qlora(checkpoint, kind)()
    assert report.trained is not None
    assert report.trained.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # the base weights are counted as the weights they stand for, not as their packed bytes
    transformers, _, _ = _packages()
    unquantized = sum(p.numel() for p in transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).parameters())
    assert report.trained.total == unquantized + report.trained.trainable


def test_qlora_with_tied_embeddings_matches_real_execution(tmp_path: Path) -> None:
    """lm_head shares the embedding's weight: transformers keeps it unquantized, and tied."""
    config = {**CONFIG, "tie_word_embeddings": True}
    ids = _ids()
    measured = measure_training(_qlora(_save(tmp_path, config), "nf4", config), [], OPTIMIZERS["adamw"], "auto",
                                kw_inputs={"input_ids": ids, "labels": ids.clone()}, also_held=_quantization_state)
    report = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], hf_config=config, mode="train",
                              optimizer="adamw", dtype="bf16", lora=LORA, quantize_base="nf4")
    assert report.train is not None
    assert report.train.peak_bytes == measured.peak_bytes
    assert {p.phase: p.peak_bytes for p in report.train.phases} == measured.phase_peaks


def test_qlora_inference_matches_real_execution(checkpoint: Path) -> None:
    measured = measure_inference(_qlora(checkpoint, "nf4"), [], kw_inputs={"input_ids": _ids()},
                                 also_held=_quantization_state)
    report = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], hf_config=CONFIG, mode="inference",
                              dtype="bf16", lora=LORA, quantize_base="nf4")
    assert report.inference is not None and report.inference.peak_bytes == measured.peak_bytes


def _outlier_columns(model: torch.nn.Module) -> int:
    """Outlier columns LLM.int8 found in the last forward, over all its layers (bitsandbytes
    keeps their indices in each layer's state)."""
    _, _, bnb = _packages()
    return sum(m.state.idx.numel() for m in model.modules()
               if isinstance(m, bnb.nn.Linear8bitLt) and getattr(m.state, "idx", None) is not None)


def _int8_inference(checkpoint: Path, norm_scale: float, assume: dict[str, str] | None = None) -> tuple[int, int, Any]:
    """(real peak, outlier columns of the real run, graphmem's inference report)."""
    models: list[torch.nn.Module] = []

    def build() -> torch.nn.Module:
        models.append(_qlora(checkpoint, "int8", norm_scale=norm_scale)())
        return models[-1]

    measured = measure_inference(build, [], kw_inputs={"input_ids": _ids()}, also_held=_quantization_state)
    report = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], hf_config=CONFIG, mode="inference",
                              dtype="bf16", lora=LORA, quantize_base="int8", assume=assume)
    assert report.inference is not None
    return measured.peak_bytes, _outlier_columns(models[-1]), report.inference


def test_int8_inference_without_outliers_matches_real_execution(checkpoint: Path) -> None:
    """LLM.int8's outlier columns depend on values; declared none (--assume nonzero=0), the
    prediction equals a real run that had none, to the byte."""
    real, outliers, predicted = _int8_inference(checkpoint, 1.0, {"nonzero": "0"})
    assert outliers == 0
    assert predicted.peak_bytes == real
    assert any("--assume nonzero=0" in a for a in predicted.assumptions)


@pytest.mark.parametrize("norm_scale", [1.0, 10.0, 40.0])
def test_int8_inference_is_an_upper_bound_of_real_runs_with_outliers(checkpoint: Path, norm_scale: float) -> None:
    """By default every column counts as an outlier: never below a real run, however many
    outliers it has (none; some; nearly all, with norms scaled by 40), and close to the worst."""
    real, outliers, predicted = _int8_inference(checkpoint, norm_scale)
    assert (outliers > 0) == (norm_scale > 1)
    assert real <= predicted.peak_bytes <= real * 1.06
    assert any(a.startswith("upper bound (int8 base)") for a in predicted.assumptions)


def test_a_quantized_base_holds_less_than_the_bf16_one() -> None:
    """What QLoRA is for: the frozen base in 4 or 8 bits instead of 16 (here the linear layers'
    weights are most of the model)."""
    kw = dict(hf_config=CONFIG, mode="train", optimizer="adamw", dtype="bf16", lora=LORA)
    lora = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], **kw)
    int8 = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], quantize_base="int8", **kw)
    nf4 = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], quantize_base="nf4", **kw)
    assert lora.train is not None and int8.train is not None and nf4.train is not None
    assert nf4.train.params_bytes < int8.train.params_bytes < lora.train.params_bytes


def test_the_cuda_target_counts_the_dequantized_weight_of_each_4bit_matmul() -> None:
    """On CUDA, bitsandbytes' 4-bit matmul over more than a few rows dequantizes the weight
    into a temporary in the input's dtype (bitsandbytes/backends/cuda/ops.py,
    _dequant_linear_fallback): out_features x in_features x 2 bytes for bf16."""
    report = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], hf_config=CONFIG, mode="train",
                              optimizer="adamw", dtype="bf16", lora=LORA, quantize_base="nf4", gpu="h100-80gb")
    assert report.train is not None
    scratch = {o.scratch_bytes for o in report.train.trace.ops if o.op == "bitsandbytes.gemm_4bit.default"}
    hidden, inner, kv = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["hidden_size"] // 2
    assert scratch == {hidden * hidden * 2, kv * hidden * 2, inner * hidden * 2}


@pytest.mark.slow
def test_plan_offers_qlora_for_a_lora_job_and_its_row_matches_real_execution(checkpoint: Path) -> None:
    from fractions import Fraction

    from graphmem.job import make_job
    from graphmem.preflight.budget import Budget
    from graphmem.preflight.plan import make_plan

    ids = _ids()
    real = measure_training(_qlora(checkpoint, "nf4"), [], OPTIMIZERS["adamw"], "auto",
                            kw_inputs={"input_ids": ids, "labels": ids.clone()}, also_held=_quantization_state)
    job = make_job("transformers:LlamaForCausalLM", [IDS], mode="train", optimizer="adamw", dtype="bf16",
                   hf_config=CONFIG, lora=LORA)
    baseline = graphmem.analyze(job).train
    assert baseline is not None
    plan = make_plan(job, Budget(baseline.peak_bytes // 2, Fraction(0), "test"))
    row = next(r for r in plan.rows if r.changes == {"quantize_base": "nf4"})
    assert row.peak_bytes == real.peak_bytes
    assert row.name == "QLoRA: the frozen base in nf4 (bitsandbytes 4-bit)"
    assert row.extra_compute == 0  # the 4-bit matmul counts the FLOPs of the matmul it replaces


def test_the_cuda_target_takes_bitsandbytes_cuda_path_for_an_int8_base() -> None:
    """On CPU tensors a training step's int8 matmul dequantizes the weight (MatMul8bitFp, the
    path the CPU reference above runs); on CUDA ones it quantizes the activations and splits
    off the outlier columns (MatMul8bitLt), a bound by default.  bitsandbytes.matmul is the
    library's own again after the recording."""
    _, _, bnb = _packages()
    original = bnb.matmul
    kw = dict(hf_config=CONFIG, mode="train", optimizer="adamw", dtype="bf16", lora=LORA, quantize_base="int8")
    cpu = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], **kw)
    cuda = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], gpu="h100-80gb", **kw)
    assert cpu.train is not None and cuda.train is not None
    assert not any(o.op.startswith("bitsandbytes.int8") for o in cpu.train.trace.ops)
    quantized = [o for o in cuda.train.trace.ops
                 if o.op == "bitsandbytes.int8_vectorwise_quant.default" and o.iteration == 0]
    assert len(quantized) == 7 * CONFIG["num_hidden_layers"]  # once per int8 layer, in the forward only
    assert {o.phase.value for o in quantized} == {"forward"}
    assert any(a.startswith("upper bound (int8 base)") for a in cuda.train.assumptions)
    assert bnb.matmul is original
