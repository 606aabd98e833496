"""KV-cache generation on a small Llama: prefill and decode peaks against real execution."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import graphmem
from tests.optional import installed
from tests.oracles import LiveStorages

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def llama() -> torch.nn.Module:
    T = installed("transformers")
    config = T.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                           num_attention_heads=4, num_key_value_heads=KV_HEADS)
    return T.LlamaForCausalLM(config)


def _real_generation(prompt: int, new: int, batch: int) -> dict[str, int]:
    """The documented procedure, for real: prefill; then a cache of prompt+new-1 tokens and
    one decode step.  Peak live bytes per phase."""
    torch.manual_seed(0)
    model = llama().eval()
    peaks: dict[str, int] = {}
    for name, length in (("prefill", prompt), ("decode", prompt + new - 1)):
        counter = LiveStorages()
        ids = torch.randint(0, 256, (batch, length))
        token = torch.randint(0, 256, (batch, 1))
        for t in [*model.parameters(), *model.buffers(), ids] + ([token] if name == "decode" else []):
            counter.add(t)
        with counter, torch.no_grad():
            counter.phase = "prefill"
            out: Any = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            if name == "decode":
                cache = out.past_key_values
                del out
                counter.phase = "decode"
                out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        peaks[name] = counter.phase_peaks[name]
    return peaks


@pytest.mark.parametrize("prompt, new, batch", [(16, 8, 2), (32, 1, 1)])
def test_prefill_and_decode_peaks_match_real_execution(prompt: int, new: int, batch: int) -> None:
    installed("transformers")  # imported before anything is measured: its import-time tensors count in nothing
    real = _real_generation(prompt, new, batch)
    report = graphmem.analyze(llama, [], generate=f"{prompt}+{new}", batch=batch).generate
    assert report is not None
    assert report.prefill_peak_bytes == real["prefill"]
    assert report.decode_peak_bytes == real["decode"]
    # the cache at the end: K and V, per layer, kv heads x head dim, fp32, prompt + new tokens
    assert report.kv_cache_bytes == 2 * LAYERS * KV_HEADS * HEAD_DIM * 4 * (prompt + new) * batch
