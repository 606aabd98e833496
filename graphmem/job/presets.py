"""Well-known model shapes, from their published config.json numbers.  Used by stage 1 (load).

``--preset NAME`` builds the Hugging Face transformers class with these config values on
the meta device: no download, no weights.  Numbers are the published configs' (the model
cards on the Hugging Face Hub); only the fields that shape memory are listed, the class's
defaults fill the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from graphmem.errors import UserInputError

__all__ = ["Preset", "PRESETS", "get_preset"]


@dataclass(frozen=True, slots=True)
class Preset:
    """A transformers class, its config values, the weights' published dtype, an example input."""

    target: str
    config: dict[str, Any] = field(default_factory=dict)
    dtype: torch.dtype | None = None
    example_input: str = "input_ids=1x1024:int64"


_LLAMA_2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)
_LLAMA_3 = dict(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                num_key_value_heads=8)

PRESETS: dict[str, Preset] = {
    "gpt2": Preset("transformers:GPT2LMHeadModel",
                   dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)),
    "gpt2-xl": Preset("transformers:GPT2LMHeadModel",
                      dict(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024)),
    "bert-base": Preset("transformers:BertForMaskedLM",
                        dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                             intermediate_size=3072, vocab_size=30522, max_position_embeddings=512),
                        example_input="input_ids=8x512:int64"),
    "t5-base": Preset("transformers:T5ForConditionalGeneration",
                      dict(d_model=768, d_ff=3072, d_kv=64, num_layers=12, num_decoder_layers=12, num_heads=12,
                           vocab_size=32128, decoder_start_token_id=0),
                      example_input="input_ids=8x512:int64 labels=8x128:int64"),
    "vit-base": Preset("transformers:ViTForImageClassification",
                       dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                            image_size=224, patch_size=16, num_labels=1000),
                       example_input="pixel_values=32x3x224x224"),
    "llama-2-7b": Preset("transformers:LlamaForCausalLM", _LLAMA_2_7B, torch.float16),
    "llama-3-8b": Preset("transformers:LlamaForCausalLM",
                         dict(_LLAMA_3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32), torch.bfloat16),
    "llama-3-70b": Preset("transformers:LlamaForCausalLM",
                          dict(_LLAMA_3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                               num_attention_heads=64), torch.bfloat16),
    "llama-3.1-405b": Preset("transformers:LlamaForCausalLM",
                             dict(_LLAMA_3, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                  num_attention_heads=128, max_position_embeddings=131072), torch.bfloat16),
    "mistral-7b": Preset("transformers:MistralForCausalLM",
                         dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                              max_position_embeddings=32768, sliding_window=4096, rms_norm_eps=1e-5),
                         torch.bfloat16),
    "qwen2-7b": Preset("transformers:Qwen2ForCausalLM",
                       dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                            num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                            rope_theta=1000000.0, rms_norm_eps=1e-6), torch.bfloat16),
    "mixtral-8x7b": Preset("transformers:MixtralForCausalLM",
                           dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                max_position_embeddings=32768, num_local_experts=8, num_experts_per_tok=2,
                                rope_theta=1000000.0, rms_norm_eps=1e-5), torch.bfloat16),
}


def get_preset(name: str) -> Preset:
    """The preset ``name``; UserInputError lists the valid ones."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise UserInputError(f"unknown preset {name!r}; expected one of: {', '.join(PRESETS)}")
    return PRESETS[key]
