"""Presets build the published model shapes: parameter counts from the model cards."""

from __future__ import annotations

import pytest

import graphmem
from tests.optional import needs

pytestmark = needs("transformers")  # every preset is a transformers class


@pytest.mark.parametrize("preset, params, bytes_per_param", [
    ("gpt2", 124_439_808, 4),          # GPT-2 small, head tied to the token embedding
    ("llama-3-8b", 8_030_261_248, 2),  # Meta-Llama-3-8B, bf16
    ("mistral-7b", 7_241_732_096, 2),  # Mistral-7B-v0.1, bf16
])
def test_preset_parameter_counts(preset: str, params: int, bytes_per_param: int) -> None:
    report = graphmem.analyze(None, ["input_ids=1x16:int64"], preset=preset, mode="inference")
    assert report.inference is not None
    assert report.inference.params_bytes == params * bytes_per_param


def test_generate_cache_size_on_llama_3_8b() -> None:
    report = graphmem.analyze(None, [], preset="llama-3-8b", generate="64+16", batch=2).generate
    assert report is not None
    # 2 (K, V) x 32 layers x 8 kv heads x 128 head dim x 2 bytes (bf16) x 80 tokens x 2 sequences
    assert report.kv_cache_bytes == 2 * 32 * 8 * 128 * 2 * 80 * 2
