"""What the plan needs to know about the model's structure, and the pruned variants it analyses.

Input: a model source (class, factory or instance) and its keyword arguments.  Output: a
frozen ``ModelFacts`` read from the model built on the meta device (no weights), and
factories that build the model with ``torch.nn.utils.prune`` applied, which graphmem then
analyses like any model.

Pruning as torch does it: ``prune.l1_unstructured(module, "weight", amount)`` renames the
parameter to ``weight_orig`` (still dense, still trained), registers a ``weight_mask`` buffer
of the same dtype and shape, and a forward pre-hook recomputes ``weight = weight_orig *
weight_mask`` at every call; the module keeps that product as a plain attribute until the
next call.  ``prune.remove`` folds the mask back into one dense parameter full of zeros.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune

from graphmem.job.load import ModelSource, build_model

__all__ = ["PRUNABLE", "ModelFacts", "block_classes", "model_facts", "position_limit", "pruned_factory"]

# Layers pruned by the plan (the usual targets of pruning: Linear and convolutions)
PRUNABLE: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """Sizes read from the model's structure (bytes in the model's own dtype).

    Attributes:
        linear_weights: (rows, cols, element bytes) of each nn.Linear weight that no other
            kind of module shares (a head tied to an embedding is left out).
        prunable_weights: (rows, cols, element bytes) of each PRUNABLE layer's weight, as a
            matrix (a convolution's weight is out_channels x the rest).
        params_bytes: bytes of all parameters, each storage once.
        block_classes: classes of repeated non-container blocks, the checkpointing candidates.
        unit_bytes: parameter bytes of the largest block (or, without blocks, of the largest
            direct child): what ZeRO-3 / FSDP gathers at once.
        batch_norm: the model has BatchNorm layers (their statistics depend on the batch).
        float_bytes: bytes per element of the floating-point parameters (the model's dtype).
    """

    linear_weights: tuple[tuple[int, int, int], ...]
    prunable_weights: tuple[tuple[int, int, int], ...]
    params_bytes: int
    block_classes: tuple[str, ...]
    unit_bytes: int
    batch_norm: bool = False
    float_bytes: int = 4

    @property
    def prunable_bytes(self) -> int:
        """Bytes of the PRUNABLE layers' weights."""
        return sum(rows * cols * size for rows, cols, size in self.prunable_weights)


def _nbytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes of ``tensor`` once floating tensors are converted to ``dtype`` (model.to(dtype))."""
    size = dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()
    return tensor.numel() * size


def _param_bytes(module: nn.Module, dtype: torch.dtype | None) -> int:
    return sum(_nbytes(p, dtype) for p in module.parameters())


def block_classes(model: nn.Module) -> tuple[str, ...]:
    """Names of classes with two or more instances that have children (not bare containers):
    the model's own classes before nn.Sequential (a ResNet's Bottleneck before its stages),
    the outermost first (a transformer's decoder layer before the attention inside it), then
    by name."""
    depth: dict[str, int] = {}
    counts: Counter[str] = Counter()
    for path, m in model.named_modules():
        if m is not model and any(True for _ in m.children()) and not isinstance(m, _CONTAINERS):
            name = type(m).__name__
            counts[name] += 1
            depth[name] = min(depth.get(name, path.count(".")), path.count("."))
    return tuple(sorted((name for name, n in counts.items() if n >= 2),
                        key=lambda name: (name == "Sequential", depth[name], name)))


def _linear_weights(model: nn.Module, dtype: torch.dtype | None) -> tuple[tuple[int, int, int], ...]:
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear)
              for p in m.parameters(recurse=False)}
    return tuple((m.weight.shape[0], m.weight.shape[1], _nbytes(m.weight, dtype) // m.weight.numel())
                 for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) not in shared)


def model_facts(source: ModelSource, kwargs: Mapping[str, Any] | None = None,
                dtype: torch.dtype | None = None, hf_config: Mapping[str, Any] | None = None,
                device: str = "cpu") -> ModelFacts:
    """Read the plan's structural sizes from the model built on meta (converted to ``dtype``)."""
    model = build_model(source, kwargs, hf_config, device=device)  # an instance is only read, never converted
    blocks = block_classes(model)
    units = [m for m in model.modules() if type(m).__name__ in blocks] or list(model.children()) or [model]
    prunable: dict[int, torch.Tensor] = {id(w): w for m in model.modules() if isinstance(m, PRUNABLE)
                                         for w in [m.get_parameter("weight")]}
    unique = {id(p): p for p in model.parameters()}
    return ModelFacts(
        linear_weights=_linear_weights(model, dtype),
        prunable_weights=tuple((w.shape[0], w.numel() // w.shape[0], _nbytes(w, dtype) // w.numel())
                               for w in prunable.values()),
        params_bytes=sum(_nbytes(p, dtype) for p in unique.values()), block_classes=blocks,
        unit_bytes=max(_param_bytes(m, dtype) for m in units),
        batch_norm=any(isinstance(m, _BATCH_NORMS) for m in model.modules()),
        float_bytes=next((_nbytes(p, dtype) // p.numel() for p in unique.values()
                          if p.is_floating_point() and p.numel()), 4))


def pruned_factory(source: ModelSource, kwargs: Mapping[str, Any] | None, amount: float,
                   remove: bool, hf_config: Mapping[str, Any] | None = None,
                   device: str = "cpu") -> Callable[[], nn.Module]:
    """A factory of the model with every PRUNABLE layer's weight pruned by L1 magnitude.

    Args:
        amount: share of each weight's entries to zero (0 < amount < 1).
        remove: also call ``prune.remove``: one dense weight with zeros, no mask.
    """
    if not 0 < amount < 1:
        raise ValueError(f"pruned_factory: amount must be in (0, 1), got {amount}")

    def build() -> nn.Module:
        model = (copy.deepcopy(source) if isinstance(source, nn.Module)
                 else build_model(source, kwargs, hf_config, device=device))
        for module in list(model.modules()):
            if isinstance(module, PRUNABLE):
                prune.l1_unstructured(module, "weight", amount=amount)
                if remove:
                    prune.remove(module, "weight")
        return model

    build.__qualname__ = f"pruned({getattr(source, '__qualname__', type(source).__name__)})"
    return build


def position_limit(model: nn.Module) -> tuple[int, str] | None:
    """The longest sequence ``model`` takes: its config's max_position_embeddings (or
    n_positions), or the size of its position-embedding table; with the reason."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value, f"the model's {key} is {value}"
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and "pos" in name.rpartition(".")[2].lower():
            return module.num_embeddings, f"its position table {name} has {module.num_embeddings} rows"
    return None
