"""Fine-tuning (--freeze, --lora) against real CPU execution, to the byte, per phase too.

The oracle side freezes parameters by name and applies peft's LoRA itself (peft's own
``get_peft_model`` with a causal-LM task, as a trainer calls it), never through graphmem.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

import graphmem
from tests.optional import installed
from tests.oracles import OPTIMIZERS, Measured, measure_training


@pytest.fixture(autouse=True)
def transformers() -> ModuleType:
    """Every test builds a transformers model: imported before anything is measured (its
    import-time tensors count in nothing), the test skipped where it is missing."""
    return installed("transformers")


@pytest.fixture
def peft(transformers: ModuleType) -> ModuleType:
    """peft, for the LoRA tests (imported after transformers, before anything is measured)."""
    return installed("peft")


# a 2-layer Llama from a local config (no download); lm_head is not tied to the embeddings
CONFIG: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=128, bos_token_id=0, eos_token_id=0)
IDS = "input_ids=2x16:int64"
FROZEN = ("model.embed_tokens.", "model.layers.0.")


def _llama() -> torch.nn.Module:
    T = installed("transformers")
    return T.LlamaForCausalLM(T.LlamaConfig(**CONFIG))


def _measure(build: Callable[[], torch.nn.Module], optimizer: str, checkpoint: tuple[str, ...] = ()) -> Measured:
    """The documented step with labels a copy of the ids (what graphmem assumes without labels)."""
    torch.manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 16))
    return measure_training(build, [], OPTIMIZERS[optimizer], "auto",
                            kw_inputs={"input_ids": ids, "labels": ids.clone()}, checkpoint_classes=checkpoint)


def _frozen_llama() -> torch.nn.Module:
    model = _llama()
    for name, param in model.named_parameters():
        if name.startswith(FROZEN):
            param.requires_grad_(False)
    return model


def _assert_same(report: graphmem.MemoryReport, measured: Measured) -> None:
    assert report.train is not None
    assert report.train.peak_bytes == measured.peak_bytes
    assert {p.phase: p.peak_bytes for p in report.train.phases} == measured.phase_peaks


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_frozen_embeddings_and_first_layer_match_real_execution(optimizer: str) -> None:
    measured = _measure(_frozen_llama, optimizer)
    report = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], hf_config=CONFIG, mode="train",
                              optimizer=optimizer, freeze=["model.embed_tokens.*", "model.layers.0.*"])
    _assert_same(report, measured)
    model = _frozen_llama()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert report.trained is not None
    assert (report.trained.trainable, report.trained.total) == (trainable, sum(p.numel() for p in model.parameters()))
    # the frozen part saves nothing for backward and has neither gradients nor AdamW state
    whole = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], hf_config=CONFIG, mode="train",
                             optimizer=optimizer)
    assert whole.train is not None and report.train is not None
    assert report.train.peak_bytes < whole.train.peak_bytes


def _lora_llama(peft: ModuleType, dropout: float = 0.0,
                dtype: torch.dtype | None = None) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        model = _llama() if dtype is None else _llama().to(dtype)
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=dropout,
                                 task_type="CAUSAL_LM")
        wrapped: torch.nn.Module = peft.get_peft_model(model, config)
        return wrapped
    return build


@pytest.mark.parametrize("dropout", [0.0, 0.05])
def test_lora_on_q_and_v_matches_real_execution(peft: ModuleType, dropout: float) -> None:
    measured = _measure(_lora_llama(peft, dropout), "adamw")
    report = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], hf_config=CONFIG, mode="train",
                              optimizer="adamw", lora=f"r=8,alpha=16,target=q_proj,v_proj,dropout={dropout}")
    _assert_same(report, measured)
    # by hand: per layer A (8x64) and B (64x8) on q_proj, A (8x64) and B (32x8) on v_proj
    assert report.trained is not None and report.trained.trainable == 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)


def test_lora_on_a_bf16_model_keeps_its_adapters_in_float32(peft: ModuleType) -> None:
    """A trainer loads the model in bf16, then get_peft_model keeps the adapters float32."""
    measured = _measure(_lora_llama(peft, dtype=torch.bfloat16), "adamw")
    report = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], hf_config=CONFIG, mode="train",
                              optimizer="adamw", dtype="bf16", lora="r=8,alpha=16,target=q_proj,v_proj")
    _assert_same(report, measured)
    assert report.train is not None
    adapters = {s.dtype for s in report.train.trace.storages if "lora_" in s.label}
    assert adapters == {"float32"}, adapters


def test_lora_with_activation_checkpointing_matches_real_execution(peft: ModuleType) -> None:
    """LoRA is mostly trained with checkpointed decoder layers (non-reentrant)."""
    measured = _measure(_lora_llama(peft), "adamw", checkpoint=("LlamaDecoderLayer",))
    report = graphmem.analyze("transformers:LlamaForCausalLM", [IDS], hf_config=CONFIG, mode="train",
                              optimizer="adamw", lora="r=8,alpha=16,target=q_proj,v_proj",
                              checkpoint=["LlamaDecoderLayer"])
    _assert_same(report, measured)


def test_lora_on_gpt2s_conv1d_layers_matches_real_execution(transformers: ModuleType, peft: ModuleType) -> None:
    """GPT-2's attention is a transformers Conv1D (weights stored transposed): peft's other layer kind."""
    config = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)

    def build() -> torch.nn.Module:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
        lora = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
        wrapped: torch.nn.Module = peft.get_peft_model(model, lora)
        return wrapped

    ids = torch.randint(0, 64, (2, 16))
    measured = measure_training(build, [], OPTIMIZERS["adamw"], "auto",
                                kw_inputs={"input_ids": ids, "labels": ids.clone()})
    report = graphmem.analyze("transformers:GPT2LMHeadModel", ["input_ids=2x16:int64"], hf_config=config,
                              mode="train", optimizer="adamw", lora="r=4,target=c_attn")
    _assert_same(report, measured)
