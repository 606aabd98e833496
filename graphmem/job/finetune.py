"""Fine-tuning as trainers set it up: frozen parameters and LoRA adapters.

Input: ``--freeze`` patterns and a ``--lora`` text (parsed and checked here, before anything
is built), then the built model.  Output: the model as the trainer trains it (frozen
parameters have ``requires_grad=False``; LoRA is peft's own ``get_peft_model``, so the
adapters and what it freezes are exactly peft's), and how many of its parameters train.
Knows nothing of tracing or reports.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from graphmem.errors import UserInputError

__all__ = ["ALL_BUT", "LORA_KEYS", "LoraSpec", "TrainedParameters", "count_trained", "parse_freeze", "parse_lora",
           "prepare_finetuning"]

ALL_BUT = "all-but:"  # --freeze all-but:PATTERN freezes every parameter the pattern does not match
LORA_KEYS = ("r", "alpha", "target", "dropout")
_PEFT_HINT = "pip install 'graphmem[lora]'"


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """peft's ``LoraConfig(r, lora_alpha, target_modules, lora_dropout)``; checked when built.

    ``targets``: module names as peft matches them (a name or its last parts, ``q_proj``), or
    ``("all-linear",)``.  ``alpha`` (peft's ``lora_alpha``, an integer) defaults to peft's default, 8.
    """

    r: int
    targets: tuple[str, ...]
    alpha: int = 8
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise UserInputError(f"--lora r={self.r!r}: expected a positive integer such as r=16")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise UserInputError("--lora needs target=MODULE[,MODULE], e.g. target=q_proj,v_proj (or all-linear)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int) or self.alpha < 1:
            raise UserInputError(f"--lora alpha={self.alpha!r}: expected a positive integer such as alpha=32")
        if not 0 <= self.dropout < 1:
            raise UserInputError(f"--lora dropout={self.dropout!r}: expected a number from 0 to below 1")

    def __str__(self) -> str:
        return f"LoRA r={self.r} on {', '.join(self.targets)}"


@dataclass(frozen=True, slots=True)
class TrainedParameters:
    """How many parameter elements train (``requires_grad``), of all (each tensor once)."""

    trainable: int
    total: int
    how: str | None  # "LoRA r=8 on q_proj, v_proj", "frozen: model.embed_tokens.*"; None: as built


def parse_lora(text: str | LoraSpec) -> LoraSpec:
    """``"r=16,alpha=32,target=q_proj,v_proj,dropout=0.05"`` -> LoraSpec.

    A part without ``=`` adds one more target (``target=q_proj,v_proj``).  peft must be
    installed, so that a run without it fails here, before anything is built.

    Raises:
        UserInputError: an unknown key, a bad value, no target, or peft missing.
    """
    if isinstance(text, LoraSpec):
        _require_peft()
        return text
    values: dict[str, list[str]] = {}
    key = None
    for part in (p.strip() for p in str(text).split(",")):
        name, eq, value = part.partition("=")
        if eq:
            key = name.strip()
            if key not in LORA_KEYS:
                raise UserInputError(f"--lora {text!r}: unknown key {key!r}; expected: {', '.join(LORA_KEYS)} "
                                     "(e.g. r=16,alpha=32,target=q_proj,v_proj)")
            values[key] = [value.strip()]
        elif part and key == "target":
            values[key].append(part)
        elif part:
            raise UserInputError(f"--lora {text!r}: {part!r} is not KEY=VALUE; expected "
                                 "r=16,alpha=32,target=q_proj,v_proj[,dropout=0.05]")
    spec = LoraSpec(r=_number(values, "r", int, None), targets=tuple(t for t in values.get("target", []) if t),
                    alpha=_number(values, "alpha", int, 8), dropout=_number(values, "dropout", float, 0.0))
    _require_peft()
    return spec


def _number(values: dict[str, list[str]], key: str, kind: type, default: Any) -> Any:
    if key not in values:
        if default is None:
            raise UserInputError(f"--lora needs {key}=N, e.g. r=16,alpha=32,target=q_proj,v_proj")
        return default
    text = values[key][0]
    try:
        return kind(text)
    except ValueError:
        example = {"r": "a positive integer such as r=16", "alpha": "a positive integer such as alpha=32",
                   "dropout": "a number such as dropout=0.05"}[key]
        raise UserInputError(f"--lora {key}={text!r}: expected {example}") from None


def _require_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise UserInputError(f"--lora needs the peft package: {_PEFT_HINT}") from None


def parse_freeze(patterns: Sequence[str] | str) -> tuple[str, ...]:
    """``"a.*,b.*"`` or ``["a.*", "b.*"]`` -> ``("a.*", "b.*")``; each a glob on parameter
    names, or ``all-but:GLOB``."""
    if isinstance(patterns, str):
        patterns = [patterns]
    found = tuple(p.strip() for text in patterns for p in str(text).split(",") if p.strip())
    for pattern in found:
        if pattern.startswith(ALL_BUT) and not pattern.removeprefix(ALL_BUT).strip():
            raise UserInputError(f"--freeze {pattern!r}: expected {ALL_BUT}GLOB, e.g. {ALL_BUT}lm_head.*")
    return found


def prepare_finetuning(module: nn.Module, freeze: Sequence[str], lora: LoraSpec | None, *,
                       dtype: torch.dtype | None = None, owned: bool = True) -> nn.Module:
    """The model as the trainer trains it: ``freeze`` patterns frozen, or peft's LoRA applied.

    Args:
        module: the built model (meta tensors), or the user's own instance (``owned`` False:
            a copy on the meta device is changed, never the instance).
        freeze: globs on parameter names (or on the name of a module holding them);
            ``all-but:GLOB`` freezes what the glob does not match.
        lora: peft's LoRA; the model is first converted to ``dtype``, as a trainer loads it
            before ``get_peft_model`` (peft then keeps the adapters in float32).
        dtype: the job's dtype, applied here only with ``lora``.

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
        if dtype is not None:
            module = module.to(dtype)
        module = _apply_lora(module, lora)
    return module


def count_trained(module: nn.Module, how: str | None) -> TrainedParameters:
    """Elements of the parameters that train, and of all of them (tied ones once)."""
    params = list(module.parameters())
    return TrainedParameters(sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params), how)


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
            raise UserInputError(f"--freeze {pattern!r} matches no parameter; names look like: {examples} "
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
            raise UserInputError(f"--lora target {target!r} matches no module; module names end in: "
                                 f"{', '.join(leaves[:12])}")
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules="all-linear" if spec.targets == ("all-linear",) else list(spec.targets))
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations peft triggers
            wrapped = get_peft_model(module, config)
    except (ValueError, TypeError) as exc:  # peft's own refusal, e.g. a layer type it cannot adapt
        raise UserInputError(f"--lora {spec}: peft refused the model: {exc}") from exc
    inner: nn.Module = wrapped.get_base_model()
    return inner
