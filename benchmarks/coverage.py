"""Coverage over a whole model library: every transformers architecture, predicted vs real CPU.

For every model type of the installed transformers that builds from a small config (the
architecture's own config class with its sizes shrunk: 2 layers, hidden size 64, 4 heads, a
256-token vocabulary, 32x32 images, ...), the natural model class from transformers' auto
mappings runs one inference call and one training step (SGD; the model's own loss where the
class takes labels, else the sum of its first floating-point output) for real on CPU under
the live-storage oracle (tests/oracles.py), and graphmem predicts both.  Each architecture runs
in its own subprocess with a timeout, so a hang or a crash never stops the sweep.

    python benchmarks/coverage.py --write docs/coverage.md     # the full sweep (hours on 2 cores)
    python benchmarks/coverage.py --only llama,bert,vit         # a few, printed
    python benchmarks/coverage.py --limit 20 --jobs 2           # the first 20, two at a time

Nothing is downloaded: configs are built locally, with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import importlib
import inspect
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# ---------------------------------------------------------------------------------------------
# Small configs

VOCAB = 256
_SPECIAL_ID = re.compile(r"(token_id|token_index|_token)$")

# (pattern on an integer config key, the largest value kept); first match wins
_INT_LIMITS: list[tuple[str, int]] = [
    (r"^window_size$", 2),
    (r"^(n_groups|mamba_n_groups)$", 1),
    (r"feat_extract|conv|codevector|_groups$|^num_labels$|^num_channels$|_window", 1 << 62),  # left alone
    (r"key_value_heads$|^n_kv_heads?$|^num_kv_heads$|^num_query_groups$", 2),
    (r"(^|_)(num_)?(hidden_)?layers$|^n_layers?$|^num_blocks$|^depth$|^n_layer$", 2),
    (r"heads$|^n_head$", 4),
    (r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_routed_experts)$", 4),
    (r"^(num_experts_per_tok|moe_topk|moe_k|num_selected_experts|top_k)$", 2),
    (r"^(n_shared_experts|num_shared_experts|n_group|topk_group|num_expert_group)$", 1),
    (r"_layer_period$", 2),
    (r"_layer_offset$", 1),
    (r"^(moe_intermediate_size|shared_expert_intermediate_size|expert_intermediate_size|expert_ffn_hidden_size)$",
     32),
    (r"intermediate_size$|ffn_dim$|^d_ff$|^n_inner$|ffn_hidden_size$|^mlp_dim$|^d_inner$|^inner_dim$", 128),
    (r"^(head_dim|d_kv|attention_head_dim|kv_channels|v_head_dim|attention_head_size)$", 16),
    (r"^rotary_dim$|^rotary_emb_base_dim$", 8),
    (r"lora_rank$", 16),
    (r"^(qk_rope_head_dim|qk_nope_head_dim)$", 8),
    (r"vocab_size$|_vocab$|^codebook_size$", VOCAB),
    (r"max_position_embeddings$|^n_positions$|^n_ctx$|^max_(source|target)_positions$", 128),
    (r"^image_size$", 32),
    (r"^context_length$", 64),
    (r"^patch_size$", 8),
    (r"hidden_size|_dim$|^dim$|^d_model$|^n_embd$|^embedding_size$|_channels$|^d_latents$", 64),
]
_LIST_LIMITS: list[tuple[str, Callable[[list[int]], list[int]]]] = [
    (r"^(depths|num_block_repeats|num_layers)$", lambda v: [min(x, 1) for x in v]),
    (r"^(hidden_sizes|embed_dims|dims|neck_hidden_sizes|hidden_dims|embed_dim|in_channels|out_channels)$",
     lambda v: [max(x // _scale(v), 1) for x in v]),
]
_HIDDEN_KEYS = ("hidden_size", "d_model", "embed_dim", "n_embd", "dim")


def _scale(values: list[int]) -> int:
    """The power of two that brings the first of ``values`` to 32 or below."""
    scale = 1
    while values[0] // scale > 32:
        scale *= 2
    return scale


def _limit(key: str, value: Any) -> Any:
    """``value`` shrunk by the first rule whose pattern matches ``key``; else unchanged."""
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        return value
    if isinstance(value, int):
        limit = next((lim for pattern, lim in _INT_LIMITS if re.search(pattern, key)), None)
        return min(value, limit) if limit is not None and value > 0 else value
    if value and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in value):
        rule = next((fn for pattern, fn in _LIST_LIMITS if re.search(pattern, key)), None)
        return rule(list(value)) if rule else value
    return value


def _shrunk_values(config: Any) -> dict[str, Any]:
    """The overrides that make ``config`` small: only changed keys, sub-configs as dicts."""
    from transformers import PretrainedConfig

    out: dict[str, Any] = {}
    for key, value in vars(config).items():
        if key.startswith("_") or key in ("transformers_version", "architectures"):
            continue
        if isinstance(value, PretrainedConfig):
            whole = {k: v for k, v in value.to_dict().items() if k != "per_layer_config"}  # derived again
            out[key] = {"model_type": value.model_type, **whole, **_shrunk_values(value)}
        elif _limit(key, value) != value and not (key == "num_layers" and hasattr(config, "depths")):
            out[key] = _limit(key, value)
    out |= _consistent(config, out)
    return {**out, **_special_ids(config, out)}


def _consistent(config: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Values that must follow the shrunk ones: per-layer lists and dicts, heads dividing the
    hidden size, an explicit head size, backbone outputs within the new depth, rope sections."""
    fixed = _kept_layers(config, out)
    now = lambda key: fixed.get(key, out.get(key, vars(config).get(key)))
    heads = now("num_attention_heads") or now("num_heads")
    staged = isinstance(heads, (list, tuple))
    keys = ("embed_dim", *_HIDDEN_KEYS) if staged else _HIDDEN_KEYS
    hidden_key = next((k for k in keys if isinstance(now(k), int)), None)
    first = heads[0] if staged and heads else heads
    if isinstance(now("num_kv_shared_layers"), int) and now("num_kv_shared_layers") > 0:
        fixed["num_kv_shared_layers"] = 0  # every kept layer computes its own cache
    if isinstance(first, int) and first > 0 and hidden_key and now(hidden_key) % first:
        fixed[hidden_key] = first * (8 if staged else 16)
    if "head_dim" in vars(config) and now("head_dim") is None and isinstance(first, int) and hidden_key:
        fixed["head_dim"] = (fixed.get(hidden_key) or now(hidden_key)) // first
    fixed |= _windows_fit(now) | _ssm_heads(now, fixed.get(hidden_key) or now(hidden_key) if hidden_key else None)
    fixed |= _backbone_channels(config, out)
    mla = isinstance(now("kv_lora_rank"), int)  # latent attention: as many key/value heads as query heads
    if "num_key_value_heads" in vars(config) and (now("num_key_value_heads") is None or mla) \
            and isinstance(first, int):
        fixed["num_key_value_heads"] = first
    return fixed | _backbone_outputs(config, out) | _rope_sections(config, out)


def _kept_layers(config: Any, out: dict[str, Any]) -> dict[str, Any]:
    """The layers kept, when the layer count shrinks: the first of each kind (per-layer lists such
    as ``layer_types`` name the kinds), then the first others; per-layer lists, per-layer dicts
    and lists of layer indices follow."""
    before, layers = getattr(config, "num_hidden_layers", None), out.get("num_hidden_layers")
    if not isinstance(before, int) or not isinstance(layers, int):
        return {}
    per_layer = {k: v for k, v in vars(config).items() if isinstance(v, list) and len(v) == before and k not in out}
    first_of_kind: set[int] = set()
    for values in per_layer.values():
        seen: dict[str, int] = {}
        for i, value in enumerate(values):
            seen.setdefault(_hashable(value), i)
        first_of_kind |= set(seen.values())
    firsts = sorted(first_of_kind)[:4]
    kept = sorted(firsts + [i for i in range(before) if i not in firsts][: max(layers - len(firsts), 0)])
    fixed: dict[str, Any] = {"num_hidden_layers": len(kept)} if len(kept) != layers else {}
    for key, value in vars(config).items():
        if key in per_layer:
            fixed[key] = [value[i] for i in kept]
        elif key == "per_layer_config" and isinstance(value, dict):
            fixed[key] = {new: value[k] for k in value for new, i in enumerate(kept) if int(k) == i}
        elif re.search(r"layers$|layer_ids$|indices$|_idx$", key) and isinstance(value, list) and value \
                and all(isinstance(i, int) and 0 <= i < before for i in value) and key not in out:
            fixed[key] = [kept.index(i) for i in value if i in kept]
    return fixed


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True, default=str)


_SSM_KEYS = [("num_heads", "head_dim", "expand"), ("mamba_num_heads", "mamba_head_dim", "expand"),
             ("mamba_n_heads", "mamba_d_head", "mamba_expand")]


def _ssm_heads(now: Callable[[str], Any], hidden: Any) -> dict[str, Any]:
    """Mamba-2 heads tile the expanded width: heads x head size == expand x hidden size."""
    for heads, head, expand in _SSM_KEYS:
        values = now(heads), now(head), now(expand)
        if all(isinstance(v, int) and v > 0 for v in values) and isinstance(hidden, int):
            return {head: int(values[2]) * hidden // int(values[0])}
    return {}


def _backbone_channels(config: Any, out: dict[str, Any]) -> dict[str, Any]:
    """A detector's encoder takes the backbone's last stages' widths (as shrunk)."""
    channels, backbone = getattr(config, "encoder_in_channels", None), out.get("backbone_config")
    sizes = backbone.get("hidden_sizes") if isinstance(backbone, dict) else None
    if not isinstance(channels, (list, tuple)) or not isinstance(sizes, list) or len(sizes) < len(channels):
        return {}
    return {"encoder_in_channels": sizes[-len(channels):]}


def _windows_fit(now: Callable[[str], Any]) -> dict[str, Any]:
    """A windowed hierarchical model (Swin): images large enough for a whole window at the last
    stage (smaller ones fail for real in transformers' Swin)."""
    window, depths, patch, size = now("window_size"), now("depths"), now("patch_size"), now("image_size")
    if not all(isinstance(v, int) for v in (window, patch, size)) or not isinstance(depths, (list, tuple)):
        return {}
    need = patch * 2 ** (len(depths) - 1) * window
    return {"image_size": need} if size < need else {}


def _backbone_outputs(config: Any, out: dict[str, Any]) -> dict[str, Any]:
    """A layer-indexed backbone keeps as many outputs as it had, on its last layers."""
    indices, layers = getattr(config, "out_indices", None), out.get("num_hidden_layers")
    if hasattr(config, "depths") or not layers or not isinstance(indices, (list, tuple)) or not indices:
        return {}
    if max(indices) <= layers:
        return {}
    depth = max(layers, len(indices))
    return {"num_hidden_layers": depth, "out_indices": list(range(depth - len(indices) + 1, depth + 1)),
            "out_features": None}


def _rope_sections(config: Any, out: dict[str, Any]) -> dict[str, Any]:
    """Multimodal rope sections sum to half the rotary head size: scaled with it (also the
    default a model's code falls back to when the config names none)."""
    rope = getattr(config, "rope_parameters", None)
    sections = rope.get("mrope_section") or _code_default_sections(config) if isinstance(rope, dict) else None
    if not isinstance(rope, dict) or not isinstance(sections, list):
        return {}
    head = out.get("head_dim") or (out.get("hidden_size", 64) // max(out.get("num_attention_heads", 4), 1))
    half = int(head * rope.get("partial_rotary_factor", 1.0)) // 2
    scaled = [max(s * half // sum(sections), 1) for s in sections]
    scaled[-1] += half - sum(scaled)
    return {"rope_parameters": {**rope, "mrope_section": scaled}}


def _code_default_sections(config: Any) -> list[int] | None:
    """``rope_parameters.get("mrope_section", [8, 12, 12])`` in the model's own code: that list."""
    module = sys.modules.get(type(config).__module__.replace(".configuration_", ".modeling_"))
    if module is None:
        try:
            module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
        except Exception:  # no modeling module of that name
            return None
    source = Path(module.__file__ or "").read_text() if getattr(module, "__file__", None) else ""
    found = re.search(r'get\("mrope_section", \[([\d, ]+)\]\)', source)
    return [int(x) for x in found.group(1).split(",")] if found else None


def _special_ids(config: Any, shrunk: dict[str, Any]) -> dict[str, Any]:
    """Token ids past the shrunk vocabulary moved to its top (distinct, from VOCAB - 1 down)."""
    vocab = shrunk.get("vocab_size", getattr(config, "vocab_size", None))
    if not isinstance(vocab, int):
        return {}
    out: dict[str, Any] = {}
    free = iter(range(vocab - 1, 0, -1))
    for key, value in sorted(vars(config).items()):
        if not _SPECIAL_ID.search(key) or isinstance(value, bool):
            continue
        if isinstance(value, int) and value >= vocab:
            out[key] = next(free)
        elif isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            if any(v >= vocab for v in value):
                out[key] = [v if v < vocab else next(free) for v in value]
    return out


def small_config(model_type: str) -> Any:
    """The model type's config class, default values with the sizes shrunk (no download).

    A config that rejects grouped key/value heads is built again with as many as query heads."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    values = _merged(_without_derived(default, _shrunk_values(default)), OVERRIDES.get(model_type, {}))
    try:
        return type(default)(**values)
    except Exception as error:
        if "key_value_heads" not in str(error):
            raise
        return type(default)(**_ungrouped(values))


def _ungrouped(values: dict[str, Any]) -> dict[str, Any]:
    out = {k: _ungrouped(v) if isinstance(v, dict) else v for k, v in values.items()}
    if "num_key_value_heads" in out and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]
    return out


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` on top, sub-config dicts merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _without_derived(default: Any, values: dict[str, Any]) -> dict[str, Any]:
    """Drop the integer overrides the config computes from the others (``qk_head_dim`` from its
    parts): built without one, the config's own value differs from its default."""
    kept = dict(values)
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        try:
            trial = type(default)(**{k: v for k, v in kept.items() if k != key})
        except Exception:  # the others alone are not a valid config: keep the key
            continue
        if vars(trial).get(key) != vars(default).get(key):
            del kept[key]
    return kept


# Per-architecture config values where the generic shrink is not enough.
_SERIES = {"prediction_length": 4, "context_length": 8, "lags_sequence": [1, 2, 3]}
OVERRIDES: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "reformer": {"is_decoder": True, "axial_pos_shape": [4, 4], "axial_pos_embds_dim": [32, 32],
                 "lsh_attn_chunk_length": 16, "local_attn_chunk_length": 16},
    "bamba": {"attn_layer_indices": [1]},
    "bit": {"num_groups": 4},
    "deepseek_v2": {"num_experts_per_tok": 2, "n_group": 1, "topk_group": 1},
    "autoformer": _SERIES, "informer": _SERIES, "time_series_transformer": _SERIES,
}

# ---------------------------------------------------------------------------------------------
# The natural model class

# auto mappings, most natural first (an encoder-decoder is a seq2seq model before a causal LM)
_TASKS = ["SEQ_TO_SEQ_CAUSAL_LM", "SPEECH_SEQ_2_SEQ", "CAUSAL_LM", "IMAGE_TEXT_TO_TEXT", "MULTIMODAL_LM",
          "MASKED_LM", "IMAGE_CLASSIFICATION", "CTC", "AUDIO_CLASSIFICATION", "SEMANTIC_SEGMENTATION",
          "DEPTH_ESTIMATION", "TIME_SERIES_PREDICTION", ""]


def architectures() -> list[str]:
    """Every model type with a model class in one of transformers' auto mappings."""
    from transformers.models.auto import modeling_auto

    types: set[str] = set()
    for name in dir(modeling_auto):
        if name.startswith("MODEL_") and name.endswith("_MAPPING_NAMES"):
            types |= set(getattr(modeling_auto, name))
    return sorted(types)


def candidate_classes(model_type: str) -> list[tuple[type, str]]:
    """(model class, task) pairs, most natural first: by the order of _TASKS, then the other
    mappings; classes declaring the model type's own config class before the others (an alias
    architecture such as exaone maps to LlamaForCausalLM)."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    mappings = {name.removeprefix("MODEL_").removeprefix("FOR_").removesuffix("MAPPING_NAMES").rstrip("_"):
                getattr(modeling_auto, name) for name in dir(modeling_auto)
                if name.startswith("MODEL_") and name.endswith("_MAPPING_NAMES")}
    config_class = type(AutoConfig.for_model(model_type))
    found: list[tuple[type, str]] = []
    for task in _TASKS + sorted(mappings):
        names = mappings.get(task, {}).get(model_type)
        for name in [names] if isinstance(names, str) else names or []:
            cls = getattr(transformers, name, None)
            if cls is not None and (cls, task or "base") not in found:
                found.append((cls, task or "base"))
    return sorted(found, key=lambda pair: not issubclass(config_class, pair[0].config_class))


# ---------------------------------------------------------------------------------------------
# Inputs derived from the class's forward signature and the config

BATCH, SEQ, TARGET_SEQ = 2, 16, 16
_TOKEN_LABELS = {"CAUSAL_LM", "MASKED_LM", "IMAGE_TEXT_TO_TEXT", "MULTIMODAL_LM", "PRETRAINING"}
_SEQ2SEQ = {"SEQ_TO_SEQ_CAUSAL_LM", "SPEECH_SEQ_2_SEQ"}
_CLASS_LABELS = {"IMAGE_CLASSIFICATION", "SEQUENCE_CLASSIFICATION", "AUDIO_CLASSIFICATION", "VIDEO_CLASSIFICATION"}


@dataclass(frozen=True)
class Input:
    """One keyword input: its shape, dtype and how a real value is drawn."""

    name: str
    shape: tuple[int, ...]
    kind: str  # ids (below ``high``), ones, float
    high: int = 2

    @property
    def spec(self) -> str:
        dtype = "" if self.kind == "float" else ":int64"
        return f"{self.name}={'x'.join(str(d) for d in self.shape)}{dtype}"

    def real(self, generator: Any) -> Any:
        import torch

        if self.kind == "float":
            return torch.randn(self.shape, generator=generator)
        if self.kind == "ones":
            return torch.ones(self.shape, dtype=torch.int64)
        return torch.randint(0, self.high, self.shape, generator=generator)


def _get(config: Any, *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` set on the config or its vision/audio sub-config."""
    subs = ("vision_config", "audio_config", "encoder_config", "encoder", "speech_config")
    for where in (config, *(getattr(config, s, None) for s in subs)):
        for key in keys:
            value = getattr(where, key, None) if where is not None else None
            if value is not None:
                return value
    return default


def _image(config: Any) -> tuple[int, ...]:
    size = _get(config, "image_size", "img_size", "input_size", default=32)
    size = list(size.values()) if isinstance(size, dict) else size
    height, width = (size[-2], size[-1]) if isinstance(size, (list, tuple)) else (size, size)
    return BATCH, _get(config, "num_channels", "in_channels", "in_chans", default=3), height, width


def _features(config: Any) -> tuple[int, ...]:
    """Speech features: (batch, mel bins, frames) for Whisper-like encoders, else (batch, frames,
    features)."""
    mels, positions = _get(config, "num_mel_bins"), _get(config, "max_source_positions")
    if mels is not None and positions is not None:  # a Whisper-like encoder: a fixed number of frames
        return BATCH, mels, 2 * positions
    per_channel = _get(config, "input_feat_per_channel", "feature_size", "num_mel_bins", default=80)
    return BATCH, 64, per_channel * _get(config, "input_channels", default=1)


def _waveform(config: Any) -> tuple[int, ...]:
    """Raw audio (batch, samples), or a spectrogram (batch, frames, mel bins) where the config
    fixes its frames (Audio Spectrogram Transformer)."""
    frames, mels = _get(config, "max_length"), _get(config, "num_mel_bins")
    if isinstance(frames, int) and isinstance(mels, int) and frames < 4096:
        return BATCH, frames, mels
    return BATCH, 4000


def _vocab(config: Any) -> int:
    try:
        text = config.get_text_config(decoder=True)
    except (ValueError, TypeError):  # several text configs (encoder, decoder): take the decoder's
        text = getattr(config, "decoder", None) or config
    vocab = getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None) or VOCAB
    return max(2, min(vocab, VOCAB) - 16)  # clear of the special ids moved to the top


def input_variants(cls: type, config: Any, task: str, mode: str) -> list[list[Input]]:
    """The keyword inputs of one call, most complete first: what the forward takes, sized from
    the config (a model taking text and images gets both, then text alone, then images alone;
    audio with its mask, then without)."""
    params = inspect.signature(cls.forward).parameters
    other = _non_text(params, config)
    text: list[Input] = []
    if "input_ids" in params and not (other and task in _NOT_TEXT):
        text = [Input("input_ids", (BATCH, SEQ), "ids", _vocab(config))]
        if "attention_mask" in params:
            text.append(Input("attention_mask", (BATCH, SEQ), "ones"))
    targets = _targets(params, config, task, mode)
    if text and other and task in ("IMAGE_TEXT_TO_TEXT", "MULTIMODAL_LM", "CAUSAL_LM"):
        return [text + targets, text + other + targets]  # a vision-language model: text first
    if not text and other and other[0].name in ("input_features", "input_values"):
        return [v + targets for v in _audio_variants(other[0], params, config)]
    variants = [text + other, text, other] if text and other else [text or other]
    return [v + targets for v in variants]


def _audio_variants(audio: Input, params: Any, config: Any) -> list[list[Input]]:
    """Audio in the layout the config suggests, then the other one (features transposed, a
    waveform with a channel dimension); each with its masks (all ones), then without."""
    masks = [name for name in ("attention_mask", "input_features_mask") if name in params]
    shape = audio.shape
    whisper = audio.name == "input_features" and _get(config, "max_source_positions") is not None
    other = (shape[0], shape[2], shape[1]) if len(shape) == 3 else (shape[0], 1, shape[1])
    variants: list[list[Input]] = []
    for layout, frames in ((shape, shape[2] if whisper else shape[1]), (other, other[1] if whisper else other[2])):
        sound = Input(audio.name, layout, "float")
        variants += [[sound, *(Input(m, (BATCH, frames), "ones") for m in masks)]] + ([[sound]] if masks else [])
    return variants


_NOT_TEXT = ("IMAGE_CLASSIFICATION", "SPEECH_SEQ_2_SEQ", "CTC", "AUDIO_CLASSIFICATION")


def _non_text(params: Any, config: Any) -> list[Input]:
    if "pixel_values" in params:
        return [Input("pixel_values", _image(config), "float")]
    if "input_features" in params:
        return [Input("input_features", _features(config), "float")]
    if "input_values" in params:
        return [Input("input_values", _waveform(config), "float")]
    if "past_values" in params:
        return _time_series(config)
    return []


def _targets(params: Any, config: Any, task: str, mode: str) -> list[Input]:
    """Labels when training and the class takes them; decoder ids for seq2seq inference."""
    seq2seq = task in _SEQ2SEQ or getattr(config, "is_encoder_decoder", False)
    if mode == "inference":
        if seq2seq and "decoder_input_ids" in params:
            return [Input("decoder_input_ids", (BATCH, TARGET_SEQ), "ids", _vocab(config))]
        return []
    if "labels" not in params:
        return []
    if task in _SEQ2SEQ:
        return [Input("labels", (BATCH, TARGET_SEQ), "ids", _vocab(config))]
    if task in _TOKEN_LABELS:
        return [Input("labels", (BATCH, SEQ), "ids", _vocab(config))]
    if task in _CLASS_LABELS:
        return [Input("labels", (BATCH,), "ids", max(getattr(config, "num_labels", 2), 1))]
    if task == "CTC":
        return [Input("labels", (BATCH, 4), "ids", _vocab(config))]
    return []


def _time_series(config: Any) -> list[Input]:
    context = config.context_length + max(getattr(config, "lags_sequence", None) or [0])
    inputs = [Input("past_values", (BATCH, context), "float"),
              Input("past_observed_mask", (BATCH, context), "ones")]
    if getattr(config, "num_time_features", 0):
        inputs.append(Input("past_time_features", (BATCH, context, config.num_time_features), "float"))
        inputs.append(Input("future_time_features", (BATCH, config.prediction_length, config.num_time_features),
                            "float"))
    return inputs


# ---------------------------------------------------------------------------------------------
# One architecture (run in a subprocess): real CPU execution, then graphmem

MAX_PARAMS = 30_000_000  # a "small" config past this is not small: not swept
MAX_VISION_PARAMS = 320_000_000  # torchvision / timm at their own sizes: up to ViT-L (the ViT-H and RegNet-128GF
# steps take minutes each on 2 cores)


def _emit(**values: Any) -> None:
    print(json.dumps(values), flush=True)


def _where(error: BaseException) -> str:
    """The innermost frame of the traceback, as file:line (relative to site-packages)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    path = tb.tb_frame.f_code.co_filename
    return f"{path.split('site-packages/')[-1].split('/work/main/')[-1]}:{tb.tb_lineno}"


def _model_line(error: BaseException) -> str:
    """The innermost line of transformers' code the error (or its cause) passed through."""
    import traceback

    cause = error.__cause__ or error
    frames = [f for f in traceback.extract_tb(cause.__traceback__) if "/transformers/" in f.filename]
    if not frames:
        return ""
    frame = frames[-1]
    return f"{frame.filename.split('/transformers/')[-1]}:{frame.lineno}: {frame.line or ''}".strip()


def _text(error: BaseException) -> str:
    return " ".join(str(error).split())[:300]


def measure(build: Callable[[], Any], mode: str, inputs: list[Input]) -> int:
    """The real CPU peak of one inference call or training step (tests/oracles.py)."""
    import torch

    from tests.oracles import OPTIMIZERS, measure_inference, measure_training

    generator = torch.Generator().manual_seed(0)
    real: dict[str, Any] = {i.name: i.real(generator) for i in inputs}
    if mode == "inference":
        return measure_inference(build, [], real).peak_bytes
    if "images" in real and _detection(build()):  # the targets graphmem makes when given none
        real["targets"] = _targets_for(build(), real["images"])
    return measure_training(build, [], OPTIMIZERS["sgd"], "auto", kw_inputs=real).peak_bytes


def _detection(model: Any) -> bool:
    return type(model).__module__.startswith("torchvision.models.detection")


def _targets_for(model: Any, images: Any) -> Any:
    """tests/oracles.py's detection targets, with masks and keypoints where the model predicts them."""
    from graphmem.trace.values.targets import target_kinds
    from tests.oracles import detection_targets

    masks, keypoints = target_kinds(model)
    return detection_targets(images, masks=masks, keypoints=keypoints)


def predict(build: Callable[[], Any], mode: str, inputs: list[Input]) -> int:
    """graphmem's peak for the step ``measure`` runs, in bytes."""
    return int(predict_report(build, mode, inputs).peak_bytes)


def predict_report(build: Callable[[], Any], mode: str, inputs: list[Input]) -> Any:
    """graphmem's report (a ModeReport) for the step ``measure`` runs."""
    import graphmem

    specs = [i.spec for i in inputs]
    if mode == "inference":
        report = graphmem.analyze(build, specs, mode="inference")
        assert report.inference is not None
        return report.inference
    report = graphmem.analyze(build, specs, mode="train", optimizer="sgd", loss="auto")
    assert report.train is not None
    return report.train


def first_buildable(config: Any, candidates: list[tuple[type, str]]) -> tuple[type, str, int]:
    """The first class that builds from the config on the meta device, its task and size."""
    import copy

    import torch

    first_error: Exception | None = None
    for cls, task in candidates:
        try:
            with torch.device("meta"):
                return cls, task, sum(p.numel() for p in cls(copy.deepcopy(config)).parameters())
        except Exception as error:
            first_error = first_error or error
    raise first_error or LookupError("no model class in transformers' auto mappings")


def worker(model_type: str, part: str, variants: list[int]) -> None:
    """One architecture, a JSON line per mode and part: the real CPU runs (the peak and which
    input variant ran), then graphmem's predictions of the modes that ran (``part`` "both"), or
    the predictions alone for the given variants (``part`` "graphmem"), or real runs routed as
    graphmem assumes (``part`` "routed")."""
    try:
        build, row, choices = _architecture(model_type)
    except Exception as error:  # the architecture itself: no small config, a missing dependency
        _emit(mode="build", status="not built", error=f"{type(error).__name__}: {_text(error)}", where=_where(error))
        return
    if row["params"] > (MAX_VISION_PARAMS if ":" in model_type else MAX_PARAMS):
        _emit(mode="build", status="not built", error=f"too large: {row['params']:,} parameters", **row)
        return
    chosen = dict(zip(choices, variants or (-1, -1), strict=True))
    if part == "routed":  # real runs whose router choices are graphmem's default assumption
        from tests.value_models import ForcedRouting

        for mode, variant in chosen.items():
            if variant >= 0:
                with ForcedRouting("uneven"):
                    _emit(part="real", mode=mode, measured=measure(build, mode, choices[mode][variant]))
        return
    if part == "both":
        for mode in choices:
            _clear_caches()  # each real run as in a fresh process: training does not reuse inference's caches
            real = _real_row(build, mode, choices[mode])
            chosen[mode] = real.get("variant", -1)
            _emit(part="real", mode=mode, **row, **real)
        _clear_caches()
    for mode, variant in chosen.items():
        if variant >= 0:
            _emit(stage=f"graphmem {mode}")
            _emit(part="graphmem", mode=mode, **_predicted_row(build, mode, choices[mode][variant]))


def _architecture(model_type: str) -> tuple[Callable[[], Any], dict[str, Any], dict[str, list[list[Input]]]]:
    """How to build one architecture, its row facts (class, task, parameters) and its input
    variants by mode: a transformers model type, or ``torchvision:NAME`` / ``timm:NAME``
    (benchmarks/coverage_vision.py)."""
    import copy

    import torch

    if ":" in model_type:
        import coverage_vision

        build, name, task, variants = coverage_vision.architecture(model_type)
        try:
            with torch.device("meta"):
                params = sum(p.numel() for p in build().parameters())
        except Exception:  # widths computed from tensor values (RegNet): counted on a real build
            params = sum(p.numel() for p in build().parameters())
        inputs = [[Input(n, shape, kind) for n, shape, kind in variant] for variant in variants]
        return build, dict(cls=name, task=task, params=params), {"inference": inputs, "train": inputs}
    config = small_config(model_type)
    cls, task, params = first_buildable(config, candidate_classes(model_type))
    build = lambda: cls(copy.deepcopy(config))  # each build gets its own config
    choices = {mode: input_variants(cls, config, task, mode) for mode in ("inference", "train")}
    return build, dict(cls=cls.__name__, task=task, params=params), choices


def _clear_caches() -> None:
    """Empty every functools.lru_cache of model code: it caches tensors by shape (transformers'
    position embeddings), and a real tensor cached by the real run must not reach the trace.
    torch's and torchvision's own caches are kept: emptying them unloads torchvision's fake
    kernels (roi_align)."""
    import functools
    import gc

    for obj in gc.get_objects():
        if isinstance(obj, functools._lru_cache_wrapper) and \
                not getattr(obj, "__module__", "").startswith(("torch", "torchvision")):
            obj.cache_clear()


def _real_row(build: Callable[[], Any], mode: str, choices: list[list[Input]]) -> dict[str, Any]:
    """The first input variant that runs for real: its peak; else why none runs."""
    first_error: Exception | None = None
    for variant, inputs in enumerate(choices):
        _emit(stage=f"real {mode}")
        try:
            return dict(status="measured", measured=measure(build, mode, inputs), variant=variant,
                        inputs=[i.spec for i in inputs])
        except Exception as error:  # the model's own failure on CPU, with these inputs
            first_error = first_error or error
    assert first_error is not None, "input_variants returned no variant"
    return dict(status="not runnable", error=f"{type(first_error).__name__}: {_text(first_error)}",
                where=_where(first_error))


def _predicted_row(build: Callable[[], Any], mode: str, inputs: list[Input]) -> dict[str, Any]:
    from graphmem.errors import GraphmemError

    start = time.perf_counter()
    try:
        report = predict_report(build, mode, inputs)
        bounds = [note for note in report.assumptions if note.startswith("upper bound")]
        routed = any(ROUTED in note for note in report.assumptions)
        return dict(status="predicted", predicted=report.peak_bytes, bounds=bounds, routed=routed,
                    seconds=time.perf_counter() - start)
    except GraphmemError as error:
        return dict(status="refused", error=_text(error), model_line=_model_line(error),
                    seconds=time.perf_counter() - start)
    except Exception as error:
        return dict(status="failed", error=f"{type(error).__name__}: {_text(error)}", where=_where(error),
                    seconds=time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# The sweep: one subprocess per architecture, results appended to a JSON-lines file

def run_one(model_type: str, timeout: float) -> list[dict[str, Any]]:
    """The rows of one architecture: its real runs, then graphmem's, in a subprocess with
    ``timeout``; a timeout or a crash becomes the row's error."""
    start = time.perf_counter()
    parts, why = _run_part(model_type, "both", [], timeout)
    if "build" in parts:
        return [{"type": model_type, "mode": "build", **parts["build"], "wall": time.perf_counter() - start}]
    rows: dict[str, dict[str, Any]] = {}
    for mode in ("inference", "train"):
        rows[mode] = parts.get(("real", mode)) or {"status": "not runnable", "error": why}
        if rows[mode]["status"] == "measured":
            rows[mode] |= parts.get(("graphmem", mode)) or {"status": "failed", "error": why}
        if rows[mode]["status"] == "predicted":
            rows[mode]["status"] = _verdict(rows[mode])
    _explain_off(model_type, rows, timeout)
    wall = time.perf_counter() - start
    return [{"type": model_type, "mode": mode, **row, "wall": wall} for mode, row in rows.items()]


def _verdict(row: dict[str, Any]) -> str:
    """exact; bound (graphmem says its peak is an upper bound, and it is not below the real
    one); else off."""
    if row["predicted"] == row["measured"]:
        return "exact"
    if row.get("bounds") and row["predicted"] > row["measured"]:
        row["error"] = row["bounds"][0]
        return "bound"
    return "off"


CHECK_EVERY = "GRAPHMEM_CHECK_EVERY_STORAGE"
ROUTED = "chooses from values graphmem does not have"  # the report's note on --assume routing


def _explain_off(model_type: str, rows: dict[str, dict[str, Any]], timeout: float) -> None:
    """For an ``off`` row, predict again with graphmem checking every live storage after every
    op (docs/benchmarks.md): exact then means a release the recorder's linear-time check missed."""
    routed = [row.get("variant", -1) if row["status"] == "off" and row.get("routed") else -1 for row in rows.values()]
    if max(routed) >= 0:  # the real run again, routed as graphmem assumed (--assume routing=uneven)
        again, why = _run_part(model_type, "routed", routed, timeout)
        for mode, row in rows.items():
            if row["status"] == "off" and row.get("routed"):
                forced = again.get(("real", mode), {}).get("measured")
                row["error"] = (f"MoE routing assumed uneven; a real run routed so: {forced:,} B, "
                                + ("exact" if forced == row["predicted"] else "also off")) if forced is not None \
                    else f"MoE routing assumed uneven; not rechecked: {why}"
    variants = [row.get("variant", -1) if row["status"] == "off" and not row.get("routed") else -1
                for row in rows.values()]
    if max(variants) < 0:
        return
    again, why = _run_part(model_type, "graphmem", variants, timeout, {CHECK_EVERY: "1"})
    for mode, row in rows.items():
        if row["status"] == "off":
            exact = again.get(("graphmem", mode), {}).get("predicted") == row["measured"]
            row["error"] = (f"exact when every storage is checked after every op ({CHECK_EVERY}=1)" if exact
                            else f"also off when every storage is checked after every op ({CHECK_EVERY}=1)"
                            if ("graphmem", mode) in again else f"not rechecked: {why}")


def _run_part(model_type: str, part: str, variants: list[int], timeout: float,
              env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """The rows a worker printed, by mode, and why any may be missing (timeout, exit code)."""
    command = [sys.executable, __file__, "--worker", model_type, "--part", part,
               "--variants=" + ",".join(map(str, variants))]  # one word: "-1,0" is no option
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **(env or {})})
        out, why = done.stdout, f"process exited with code {done.returncode}"
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
        why = f"timeout after {timeout:.0f} s"
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    built = [line for line in lines if line.get("mode") == "build"]
    rows: dict[Any, dict[str, Any]] = {"build": built[0]} if built else {}
    rows |= {(line.pop("part"), line.pop("mode")): line for line in lines if "part" in line}
    stage = next((line["stage"] for line in reversed(lines) if "stage" in line), "")
    return rows, f"{why} ({stage})" if stage else why


def sweep(types: list[str], results: Path, timeout: float, jobs: int) -> list[dict[str, Any]]:
    """Every architecture not yet in ``results``; returns all rows in the file."""
    done = {row["type"] for row in _read(results)}
    todo = [t for t in types if t not in done]
    with ThreadPoolExecutor(max_workers=jobs) as pool, results.open("a") as out:
        for index, rows in enumerate(pool.map(lambda t: run_one(t, timeout), todo), 1):
            for row in rows:
                out.write(json.dumps(row) + "\n")
            out.flush()
            summary = ", ".join(f"{r['mode']} {r['status']}" for r in rows)
            print(f"[{index}/{len(todo)}] {rows[0]['type']}: {summary} ({rows[0]['wall']:.0f} s)", file=sys.stderr)
    return [row for row in _read(results) if row["type"] in set(types)]


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


# ---------------------------------------------------------------------------------------------
# The page

STATUSES = ("exact", "bound", "off", "refused", "failed", "not runnable")


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if row["status"] == "exact":
        return "exact"
    if row["status"] in ("off", "bound"):
        return f"{row['status']} {(row['predicted'] - row['measured']) / row['measured']:+.2%}"
    return f"{row['status']}: {_short(row.get('error', ''), 70)}"


def _short(text: str, width: int) -> str:
    text = text.replace("|", "/").replace("`", "'")
    return text if len(text) <= width else text[: width - 1] + "…"


def _seconds(row: dict[str, Any] | None) -> str:
    return f"{row['seconds']:.1f}" if row and "seconds" in row else "-"


def table(rows: list[dict[str, Any]]) -> str:
    by_type: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_type.setdefault(row["type"], {})[row["mode"]] = row
    lines = ["| architecture | class | parameters | inference | training | analysis s (inf / train) |",
             "|---|---|---:|---|---|---:|"]
    for name, modes in sorted(by_type.items()):
        if "build" in modes:
            continue
        some = modes.get("inference") or modes.get("train") or {}
        params = f"{some['params']:,}" if "params" in some else "-"
        lines.append(f"| {name} | {some.get('cls', '-')} | {params} | {_cell(modes.get('inference'))} "
                     f"| {_cell(modes.get('train'))} | {_seconds(modes.get('inference'))} / "
                     f"{_seconds(modes.get('train'))} |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    lines = ["| | " + " | ".join(STATUSES) + " | exact among those real CPU execution runs | exact or bound |",
             "|---|" + "---:|" * (len(STATUSES) + 2)]
    for mode in ("inference", "train", None):
        chosen = [r for r in rows if r["mode"] != "build" and (mode is None or r["mode"] == mode)]
        counts = {s: sum(r["status"] == s for r in chosen) for s in STATUSES}
        runnable = sum(counts.values()) - counts["not runnable"]
        good = counts["exact"] + counts["bound"]
        ratio = f"{counts['exact'] / runnable:.1%} ({counts['exact']}/{runnable})" if runnable else "-"
        either = f"{good / runnable:.1%} ({good}/{runnable})" if runnable else "-"
        label = {"inference": "inference", "train": "training step", None: "**both**"}[mode]
        lines.append(f"| {label} | " + " | ".join(str(counts[s]) for s in STATUSES) + f" | {ratio} | {either} |")
    return "\n".join(lines)


def _if_release_fixed(rows: list[dict[str, Any]]) -> str:
    """The ratio if the rows that are exact when every storage is checked after every op were."""
    runnable = [r for r in rows if r["status"] != "not runnable"]
    fixed = [r for r in runnable if r["status"] == "exact" or "exact when every storage" in r.get("error", "")]
    if not runnable or len(fixed) == sum(r["status"] == "exact" for r in runnable):
        return ""
    return (f"{len(fixed) - sum(r['status'] == 'exact' for r in runnable)} of the off rows came out exact when "
            f"graphmem was run again checking every live storage after every op ({CHECK_EVERY}=1, "
            "docs/benchmarks.md): a release the linear-time check misses, or a step that is not the same twice "
            "(see the causes below).")


def _cause(row: dict[str, Any]) -> str:
    """An error message with its numbers, quoted names and module paths blurred, to group rows
    by; for a refusal, the model's own line that led to it (its code, not its file)."""
    text = re.sub(r"^\S+ \((\w+) phase, op ([\w.]+)\)", r"(\1 phase, op \2)", row.get("error", ""))
    if row["status"] == "bound":
        text = re.sub(r" in [\w.]+ depends", " in … depends", text.split(";")[0])
    if row["status"] == "refused":
        text = text.split(";")[0].split(": data-dependent")[0].split(" x.fake_mode")[0]
    text = re.sub(r"(?<![A-Za-z_=])\d+", "N", text)
    text = re.sub(r"'[^']*'", "'…'", text)
    text = re.sub(r"\w+\.forward\(\)", "forward()", text)
    where = re.sub(r":\d+$", "", row.get("where", ""))
    line = row.get("model_line", "").split(": ", 1)[-1]
    return _short(text, 110) + (f" (at {where})" if where and row["status"] == "failed" else "") + \
        (f" — at `{_short(line, 70)}`" if line else "")


# Why a cause happens, where it is known (pattern on the cause, explanation)
EXPLANATIONS: list[tuple[str, str]] = [
    ("exact when every storage", "the step is not the same twice: the model reads a random value other than a "
     "uniform draw (a uniform draw is answered with its largest value), so the recorded step differs from the "
     "real run's"),
    ("also off when every storage", "another cause, not the release check"),
    ("Mixing fake modes", "model code caches a tensor by shape (functools.lru_cache on position or rotary "
     "embeddings); the inference recording's fake tensor reaches the training recording"),
    ("routing assumed uneven", "graphmem took the router's choices as --assume routing=uneven (its default) "
     "spreads them, and a real run routed the same way is exact; the real run here routes by its random values"),
    ("upper bound", "graphmem recorded a value-dependent op at its worst case (every element kept, or as many "
     "as the model's own sampler can pick; a predicted box as the whole image) and says so; the real run, on "
     "random inputs and weights, kept fewer"),
    ("_ctc_loss", "CTC loss needs the values of the target lengths, and they are not known here (not computed "
     "from an assumed input)"),
    ("mask", "a value of a mask computed from the attention mask (an input, assumed all ones): the known values "
     "are lost on the way"),
    ("expert", "MoE routing read as Python numbers (`.tolist()` of expert sizes, `if expert_idx == ...`)"),
    ("_local_scalar_dense", "the model reads a value computed at run time (padding sizes, coordinates, "
     "a structure check)"),
]


def _explained(cause: str) -> str:
    return next((why for pattern, why in EXPLANATIONS if pattern in cause), "")


def causes(rows: list[dict[str, Any]], statuses: tuple[str, ...], top: int = 15) -> str:
    groups: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        if row["status"] in statuses:
            groups.setdefault((row["status"], _cause(row)), []).append(f"{row['type']} ({row['mode']})")
    ranked = sorted(groups.items(), key=lambda item: -len(item[1]))[:top]
    lines = ["| count | status | cause | why | examples |", "|---:|---|---|---|---|"]
    for (status, cause), names in ranked:
        shown = ", ".join(sorted(names)[:4]) + (", …" if len(names) > 4 else "")
        lines.append(f"| {len(names)} | {status} | {cause} | {_explained(cause)} | {shown} |")
    return "\n".join(lines)


def page(rows: list[dict[str, Any]], seconds: float) -> str:
    import torch
    import transformers

    built = [r for r in rows if r["mode"] != "build"]
    swept = len({r["type"] for r in built})
    not_built = [r for r in rows if r["mode"] == "build"]
    return f"""# Coverage: every transformers architecture, predicted vs real CPU execution

Generated by `python benchmarks/coverage.py --write docs/coverage.md` with torch {torch.__version__} and
transformers {transformers.__version__}, offline (configs built locally, nothing downloaded).

For each of the {len({r['type'] for r in rows})} model types of transformers' auto mappings, the
architecture's own config class with its sizes shrunk (2 layers, hidden size 64, 4 heads, a {VOCAB}-token
vocabulary, 32x32 images, ...; `benchmarks/coverage.py`), the natural model class (causal LM, seq2seq LM,
masked LM, image or audio classifier, else the base model) and inputs derived from its forward signature
(batch {BATCH}, {SEQ} tokens). Each runs for real on CPU under the live-storage oracle
(`tests/oracles.py`): one inference call under `torch.no_grad()`, and a training step (SGD, two
iterations; the model's own loss from `labels` where the class takes labels, else the sum of its first
floating-point output). graphmem predicts the same step with `device="cpu"`.

- **exact**: predicted peak == measured peak, to the byte; **bound**: graphmem says its peak is an
  upper bound (a value-dependent op recorded at its worst case) and the real peak is not above it
  (how far above it is, in %); **off**: the error (predicted - measured) / measured; **refused**:
  graphmem stopped with a clear error (its message); **failed**: graphmem crashed (the exception);
  **not runnable**: the real CPU run fails with every input variant the sweep derives, so there is no
  ground truth (left out of the ratios). Most of these are the sweep's limits, not the model's: a
  forward that needs inputs the sweep does not make (image grids, bounding boxes, query embeddings),
  or a config the generic shrinking leaves inconsistent.
- Real runs and graphmem run in one subprocess per architecture (every `functools.lru_cache` is
  emptied before each real run and before graphmem's, so a real training step does not reuse what the
  inference call cached); graphmem records inference, then training, as `--mode both` does.
- Analysis time: graphmem's wall time for the mode, building included, on a shared 2-core machine.

{summary(rows)}

{_if_release_fixed(built)}

{swept} architectures swept; {len(not_built)} not built (below). The sweep's wall time: {seconds / 3600:.1f} h.

## Where graphmem is not exact

{causes(built, ("bound", "off", "refused", "failed"), top=20)}

## Where the real run fails (no ground truth)

{causes(built, ("not runnable",), top=12)}

## Not built from a small config

timm and torchvision are swept on their own pages, [coverage-torchvision.md](coverage-torchvision.md)
and [coverage-timm.md](coverage-timm.md) (`--library torchvision|timm`): with torch 2.13.0+cpu the
registry's torchvision 0.28.0 is a CUDA build whose operator library needs libtorch_cuda ("operator
torchvision::nms does not exist"), so those sweeps run in their own virtualenv with torch 2.14.1 and
torchvision 0.29.1 (CUDA builds, run on the CPU). In this one, transformers classes that wrap timm
(TimmBackbone, TimmWrapper) are not built for the same reason.

{causes(not_built, ("not built",), top=40)}

## All architectures

{table(rows)}
"""


def vision_page(rows: list[dict[str, Any]], seconds: float, library: str) -> str:
    """The page of a torchvision or timm sweep."""
    import torch

    module = __import__(library)
    built = [r for r in rows if r["mode"] != "build"]
    not_built = [r for r in rows if r["mode"] == "build"]
    return f"""# Coverage: {library} models, predicted vs real CPU execution

Generated by `python benchmarks/coverage.py --library {library} --write docs/coverage-{library}.md` with torch
{torch.__version__} and {library} {module.__version__} (their own virtualenv: `pip install torch==2.14.1
torchvision==0.29.1 timm networkx tabulate click`, then the command with this checkout as the working
directory), random weights, nothing downloaded (the models and inputs: `benchmarks/coverage_vision.py`).
Each model runs for real on CPU under the live-storage oracle (`tests/oracles.py`): one inference call
under `torch.no_grad()` and a training step (SGD, two iterations, the sum of the first floating-point
output as the loss; a detection model: the sum of its losses on the targets graphmem makes when given
none, 8 boxes per image, built for the real run by `tests/oracles.py`), and graphmem predicts both with
`device="cpu"`. The words are those of docs/coverage.md.

{summary(rows)}

{len({r['type'] for r in built})} models swept; {len(not_built)} not built. The sweep's wall time:
{seconds / 3600:.1f} h on a shared 2-core machine.

## Where graphmem is not exact

{causes(built, ("bound", "off", "refused", "failed"), top=20)}

## Where the real run fails (no ground truth)

{causes(built, ("not runnable",), top=12)}

## Not built

{causes(not_built, ("not built",), top=20)}

## All models

{table(rows)}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, help="write the markdown page here")
    parser.add_argument("--only", help="comma-separated model types (e.g. llama,bert,vit, torchvision:resnet18)")
    parser.add_argument("--library", choices=("transformers", "torchvision", "timm"), default="transformers",
                        help="what to sweep (default transformers; torchvision and timm: coverage_vision.py)")
    parser.add_argument("--limit", type=int, help="only the first N model types")
    parser.add_argument("--jobs", type=int, default=1, help="architectures run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per architecture (default 600)")
    parser.add_argument("--results", type=Path, help="JSON-lines file the rows are appended to; architectures "
                        "already in it are skipped, so an interrupted sweep resumes (default: a new temporary file)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--variants", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _quiet()
        worker(args.worker, args.part, [int(v) for v in args.variants.split(",") if v])
        return
    if args.library == "transformers":
        everything = architectures()
    else:
        import coverage_vision

        everything = coverage_vision.architectures(args.library)
    types = args.only.split(",") if args.only else everything[: args.limit]
    if args.results is None:
        args.results = Path(tempfile.mkdtemp(prefix="graphmem-coverage-")) / "rows.jsonl"
    start = time.perf_counter()
    rows = sweep(types, args.results, args.timeout, args.jobs)
    walls = {row["type"]: row.get("wall", 0.0) for row in rows}
    seconds = max(time.perf_counter() - start, sum(walls.values()) / args.jobs)
    text = page(rows, seconds) if args.library == "transformers" else vision_page(rows, seconds, args.library)
    if args.write:
        args.write.write_text(text)
    print(text)


def _quiet() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging
    except ImportError:  # the torchvision / timm sweep runs without transformers
        return
    logging.set_verbosity_error()


if __name__ == "__main__":
    main()
