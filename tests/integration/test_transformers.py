"""Hugging Face transformers models, built from local configs only, against real execution."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphmem
from tests.optional import installed
from tests.oracles import OPTIMIZERS, measure_inference, measure_training


@pytest.fixture(autouse=True)
def _transformers() -> None:
    """Every test builds a transformers model: imported before anything is measured (its
    import-time tensors count in nothing), the test skipped where it is missing."""
    installed("transformers")


SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
IDS = "input_ids=2x32:int64"


def _build(cls_name: str, config_name: str, **config: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        T = installed("transformers")
        return getattr(T, cls_name)(getattr(T, config_name)(**config))
    return build


CASES = [
    ("gpt2", _build("GPT2LMHeadModel", "GPT2Config", vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                    n_positions=64, bos_token_id=0, eos_token_id=0), [IDS, "labels=2x32:int64"]),
    ("bert", _build("BertForSequenceClassification", "BertConfig", **SMALL),
     [IDS, "attention_mask=2x32:int64", "labels=2:int64"]),
    ("llama", _build("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2, **SMALL),
     [IDS, "attention_mask=2x32:int64", "labels=2x32:int64"]),
    ("mistral", _build("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, **SMALL),
     [IDS, "labels=2x32:int64"]),
    ("qwen2", _build("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2, **SMALL), [IDS, "labels=2x32:int64"]),
    ("vit", _build("ViTForImageClassification", "ViTConfig", hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8, num_labels=10),
     ["pixel_values=2x3x32x32", "labels=2:int64"]),
    ("t5", _build("T5ForConditionalGeneration", "T5Config", vocab_size=256, d_model=64, d_kv=16, d_ff=128,
                  num_layers=2, num_heads=4, decoder_start_token_id=0), [IDS, "labels=2x16:int64"]),
]


def _real(specs: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        dims, _, dtype = rest.partition(":")
        shape = tuple(int(d) for d in dims.split("x"))
        if dtype == "int64":
            # masks all ones (graphmem's default assumption); ids and labels small valid classes
            out[name] = torch.ones(shape, dtype=torch.int64) if "mask" in name else torch.randint(0, 2, shape)
        else:
            out[name] = torch.randn(shape)
    return out


@pytest.mark.parametrize("name, build, specs", CASES, ids=[c[0] for c in CASES])
def test_inference_matches_real_execution(name: str, build: Any, specs: list[str]) -> None:
    measured = measure_inference(build, [], _real(specs))
    report = graphmem.analyze(build, specs, mode="inference")
    assert report.inference is not None
    assert report.inference.peak_bytes == measured.peak_bytes


@pytest.mark.parametrize("name, build, specs", CASES, ids=[c[0] for c in CASES])
def test_training_with_labels_matches_real_execution(name: str, build: Any, specs: list[str]) -> None:
    measured = measure_training(build, [], OPTIMIZERS["adamw"], "auto", kw_inputs=_real(specs))
    report = graphmem.analyze(build, specs, mode="train", optimizer="adamw")
    assert report.train is not None
    assert report.train.peak_bytes == measured.peak_bytes


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_causal_lm_without_labels_trains_on_its_input_ids(name: str) -> None:
    """As trainers do: labels are a copy of the input ids, and the model's own loss runs."""
    build, specs = next((c[1], c[2]) for c in CASES if c[0] == name)
    ids_only = [s for s in specs if not s.startswith("labels")]
    real = _real(ids_only)
    real["labels"] = real["input_ids"].clone()
    measured = measure_training(build, [], OPTIMIZERS["adamw"], "auto", kw_inputs=real)
    report = graphmem.analyze(build, ids_only, mode="train", optimizer="adamw")
    assert report.train is not None
    assert report.train.peak_bytes == measured.peak_bytes
    assert any("input ids are used as labels" in note for note in report.train.assumptions)


def test_a_configs_torch_dtype_is_the_models_dtype() -> None:
    config = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    declared = graphmem.analyze("transformers:GPT2LMHeadModel", [IDS], mode="inference",
                                hf_config={**config, "torch_dtype": "bfloat16"})
    explicit = graphmem.analyze("transformers:GPT2LMHeadModel", [IDS], mode="inference", hf_config=config,
                                dtype="bfloat16")
    assert declared.inference is not None and explicit.inference is not None
    assert declared.inference.timeline == explicit.inference.timeline
    params = [s for s in declared.inference.trace.storages if "parameter" in {str(r) for r in s.roles}]
    assert params and {s.dtype for s in params} == {"bfloat16"}


def test_checkpointing_a_transformers_model_trains_without_its_cache() -> None:
    """transformers' own gradient checkpointing turns use_cache off while training; so does
    --checkpoint (else every recompute appends to the cache again)."""
    build, specs = next((c[1], c[2]) for c in CASES if c[0] == "llama")
    measured = measure_training(build, [], OPTIMIZERS["adamw"], "auto", kw_inputs=_real(specs),
                                checkpoint_classes=("LlamaDecoderLayer",))
    report = graphmem.analyze(build, specs, mode="train", optimizer="adamw", checkpoint=["LlamaDecoderLayer"])
    assert report.train is not None
    assert report.train.peak_bytes == measured.peak_bytes
