"""Fine-tuning as trainers set it up: frozen parameters and LoRA adapters.

Input: ``--freeze`` patterns, a ``--lora`` text and a ``--quantize-base`` kind (parsed and
checked here, before anything is built), then the built model.  Output: the model as the
trainer trains it (frozen parameters have ``requires_grad=False``; LoRA is peft's own
``get_peft_model``, so the adapters and what it freezes are exactly peft's; a quantized base
(QLoRA) is transformers' own bitsandbytes conversion, each weight quantized by bitsandbytes'
own op on the meta device), and how many of its parameters train.
Knows nothing of tracing or reports.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import module_buffers, module_non_persistent_buffers, module_parameters, quantized_on_meta
from graphmem.errors import UserInputError
from graphmem.job.choices import QUANTIZED_BASES
from graphmem.job.lora_spec import LORA_KEYS, LoraSpec, read_lora
from graphmem.job.lora_spec import quiet_logger as _quiet_logger
from graphmem.job.lora_spec import require_peft as _require_peft
from graphmem.job.option import spelling

__all__ = ["ALL_BUT", "LORA_KEYS", "QUANTIZED_BASES", "LoraSpec", "TrainedParameters", "count_trained",
           "parse_freeze", "parse_lora", "parse_quantize_base", "prepare_finetuning"]

ALL_BUT = "all-but:"  # --freeze all-but:PATTERN freezes every parameter the pattern does not match
_QLORA_HINT = "pip install 'graphmem[qlora]'"


@dataclass(frozen=True, slots=True)
class TrainedParameters:
    """How many parameter elements train (``requires_grad``), of all (each tensor once)."""

    trainable: int
    total: int
    how: str | None  # "LoRA r=8 on q_proj, v_proj", "frozen: model.embed_tokens.*"; None: as built


def parse_lora(text: str | LoraSpec) -> LoraSpec:
    """``"r=16,alpha=32,target=q_proj,v_proj,dropout=0.05"`` -> LoraSpec (``read_lora``).

    peft must be installed, so that a run without it fails here, before anything is built.

    Raises:
        UserInputError: an unknown key, a bad value, no target, or peft missing.
    """
    spec = text if isinstance(text, LoraSpec) else read_lora(text)
    _require_peft()
    return spec


def parse_quantize_base(kind: str | None) -> str | None:
    """``nf4`` / ``nf4-dq`` (double quantization) / ``fp4`` / ``int8`` (LLM.int8), checked;
    bitsandbytes, transformers and peft must be installed.

    Raises:
        UserInputError: an unknown kind, or a package missing.
    """
    if kind is None:
        return None
    if kind not in QUANTIZED_BASES:
        raise UserInputError(f"{spelling('quantize_base')} {kind!r}: expected one of: {', '.join(QUANTIZED_BASES)} "
                             "(nf4-dq: nf4 with double quantization of the scales; int8: LLM.int8)")
    for package in ("bitsandbytes", "transformers", "peft"):
        try:
            with _quiet_logger("bitsandbytes"):  # its notes on optional CPU kernels, at import
                __import__(package)
        except ImportError:
            raise UserInputError(f"{spelling('quantize_base')} needs the {package} package: {_QLORA_HINT}") from None
    return kind


def parse_freeze(patterns: Sequence[str] | str) -> tuple[str, ...]:
    """``"a.*,b.*"`` or ``["a.*", "b.*"]`` -> ``("a.*", "b.*")``; each a glob on parameter
    names, or ``all-but:GLOB``."""
    if isinstance(patterns, str):
        patterns = [patterns]
    found = tuple(p.strip() for text in patterns for p in str(text).split(",") if p.strip())
    for pattern in found:
        if pattern.startswith(ALL_BUT) and not pattern.removeprefix(ALL_BUT).strip():
            raise UserInputError(f"{spelling('freeze')} {pattern!r}: expected {ALL_BUT}GLOB, e.g. {ALL_BUT}lm_head.*")
    return found


def prepare_finetuning(module: nn.Module, freeze: Sequence[str], lora: LoraSpec | None, *,
                       dtype: torch.dtype | None = None, owned: bool = True,
                       quantize: str | None = None) -> nn.Module:
    """The model as the trainer trains it: ``freeze`` patterns frozen, or peft's LoRA applied
    (on a quantized base with ``quantize``).

    Args:
        module: the built model (meta tensors), or the user's own instance (``owned`` False:
            a copy on the meta device is changed, never the instance).
        freeze: globs on parameter names (or on the name of a module holding them);
            ``all-but:GLOB`` freezes what the glob does not match.
        lora: peft's LoRA; the model is first converted to ``dtype``, as a trainer loads it
            before ``get_peft_model`` (peft then keeps the adapters in float32).
        dtype: the job's dtype, applied here only with ``lora``.
        quantize: a QUANTIZED_BASES kind: before LoRA, the linear layers become bitsandbytes'
            4-bit or 8-bit ones as ``from_pretrained(..., quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, ...))`` (compute dtype: ``dtype``) or ``load_in_8bit=True``
            loads them, frozen.

    Returns:
        The module to trace: ``module`` or its copy, changed.

    Raises:
        UserInputError: a pattern or target matches nothing, or peft refuses the model.
    """
    if not freeze and lora is None:
        return module
    if not owned:
        module = _meta_copy(module)
    if freeze:
        _freeze(module, freeze)
    if lora is not None:
        if dtype is not None and quantize is not None:
            _load_in(module, dtype)
        elif dtype is not None:
            module = module.to(dtype)
        if quantize is not None:
            _quantize_base(module, quantize, dtype or torch.float32)
        module = _apply_lora(module, lora)
    return module


def count_trained(module: nn.Module, how: str | None) -> TrainedParameters:
    """Elements of the parameters that train, and of all of them (tied ones once)."""
    params = list(module.parameters())
    return TrainedParameters(sum(_elements(p) for p in params if p.requires_grad), sum(_elements(p) for p in params),
                             how)


def _elements(param: torch.Tensor) -> int:
    """A 4-bit quantized weight (two per byte) counts the elements of the weight it stands for."""
    state = getattr(param, "quant_state", None)
    shape = getattr(state, "shape", None)
    return int(math.prod(shape)) if shape is not None else param.numel()


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy whose parameters and buffers are meta tensors (the user's instance stays as it is)."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _freeze(module: nn.Module, patterns: Sequence[str]) -> None:
    named = list(module.named_parameters(remove_duplicate=False))
    keep = [p.removeprefix(ALL_BUT) for p in patterns if p.startswith(ALL_BUT)]
    frozen = [p for p in patterns if not p.startswith(ALL_BUT)]
    for pattern in [*frozen, *keep]:
        if not any(_matches(name, pattern) for name, _ in named):
            examples = ", ".join(name for name, _ in named[:4])
            raise UserInputError(f"{spelling('freeze')} {pattern!r} matches no parameter; names look like: {examples} "
                                 f"({len(named)} in all; * matches any text, e.g. 'model.layers.0.*')")
    kept = {id(p) for name, p in named if any(_matches(name, k) for k in keep)}
    for name, param in named:
        if any(_matches(name, f) for f in frozen) or (keep and id(param) not in kept):
            param.requires_grad_(False)


def _matches(name: str, pattern: str) -> bool:
    """The parameter's name, or the name of a module holding it, matches the glob."""
    parts = name.split(".")
    return any(fnmatchcase(".".join(parts[:n]), pattern) for n in range(len(parts), 0, -1))


def _apply_lora(module: nn.Module, spec: LoraSpec) -> nn.Module:
    """peft's get_peft_model on the meta device; the model it wraps, now with adapters."""
    from peft import LoraConfig, get_peft_model

    names = [name for name, _ in module.named_modules() if name]
    for target in spec.targets if spec.targets != ("all-linear",) else ():
        if not any(name == target or name.endswith("." + target) for name in names):
            leaves = sorted({n.rsplit(".", 1)[-1] for n, m in module.named_modules()
                             if n and not any(m.children()) and not n.rsplit(".", 1)[-1].isdigit()})
            raise UserInputError(f"{spelling('lora')} target {target!r} matches no module; module names end in: "
                                 f"{', '.join(leaves[:12])}")
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules="all-linear" if spec.targets == ("all-linear",) else list(spec.targets))
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations peft triggers
            wrapped = get_peft_model(module, config)
    except (ValueError, TypeError) as exc:  # peft's own refusal, e.g. a layer type it cannot adapt
        raise UserInputError(f"{spelling('lora')} {spec}: peft refused the model: {exc}") from exc
    inner: nn.Module = wrapped.get_base_model()
    return inner


def _load_in(module: nn.Module, dtype: torch.dtype) -> None:
    """As ``from_pretrained(..., dtype=dtype)`` loads a model (the only way to a quantized base):
    parameters and saved buffers in ``dtype``; the buffers a model computes itself
    (non-persistent: rotary frequencies) kept as it computes them.  In place."""
    loaded: dict[int, nn.Parameter] = {}  # tied parameters stay tied
    for sub in module.modules():
        for name, param in list(module_parameters(sub).items()):
            if param is not None and param.is_floating_point():
                if id(param) not in loaded:
                    loaded[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                module_parameters(sub)[name] = loaded[id(param)]
        for name, buffer in list(module_buffers(sub).items()):
            if buffer is not None and buffer.is_floating_point() and name not in module_non_persistent_buffers(sub):
                module_buffers(sub)[name] = buffer.to(dtype)


def _quantize_base(module: nn.Module, kind: str, dtype: torch.dtype) -> None:
    """transformers' own ``replace_with_bnb_linear`` (what from_pretrained does with a
    BitsAndBytesConfig, skipping what its quantizer skips: the output embeddings, tied and
    last weights), then each new weight loaded in ``dtype`` and quantized by bitsandbytes on
    the meta device, as from_pretrained quantizes each loaded weight.  In place."""
    with _quiet_logger("bitsandbytes"):
        from bitsandbytes.nn.modules import Int8Params, Linear4bit, Linear8bitLt, Params4bit
    from transformers import BitsAndBytesConfig, PreTrainedModel
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    eight_bit = QUANTIZED_BASES[kind].get("load_in_8bit", False)
    config = BitsAndBytesConfig(**QUANTIZED_BASES[kind], **({} if eight_bit else {"bnb_4bit_compute_dtype": dtype}))
    skip: list[str] = []
    if isinstance(module, PreTrainedModel):
        from transformers.quantizers.base import HfQuantizer
        skip = HfQuantizer.get_modules_to_not_convert(module, None, getattr(module, "_keep_in_fp32_modules", None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' notes on optional CPU kernels
        replace_with_bnb_linear(module, modules_to_not_convert=skip, quantization_config=config)
        layers = [m for m in module.modules() if isinstance(m, Linear8bitLt if eight_bit else Linear4bit)]
        if not layers:
            raise UserInputError(f"{spelling('quantize_base')} {kind}: the model has no linear layer to quantize")
        for layer in layers:
            loaded = torch.empty(layer.weight.shape, dtype=dtype, device="meta")
            if eight_bit:  # row-wise int8 (CB, the weight's own storage) and a float32 scale per row (SCB)
                attributes = {k: v for k, v in vars(layer.weight).items() if k not in ("CB", "SCB")}
                layer.weight = quantized_on_meta(Int8Params(loaded, requires_grad=False, **attributes))
            else:
                attributes = {k: v for k, v in vars(layer.weight).items() if k != "bnb_quantized"}
                layer.weight = quantized_on_meta(Params4bit(loaded, requires_grad=False, **attributes))
                # inference as on a GPU: not the weight repacked for AVX512-BF16 CPUs' fused kernel
                layer.support_avx512bf16_for_cpu = False
            if layer.bias is not None:
                layer.bias = nn.Parameter(torch.empty_like(layer.bias, dtype=dtype), requires_grad=False)
    # as from_pretrained marks the model; peft reads it
    setattr(module, "is_loaded_in_8bit" if eight_bit else "is_loaded_in_4bit", True)
