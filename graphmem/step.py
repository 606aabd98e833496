"""What one training step runs: the optimizer choices and the loss functions.

Used by stage 2 (trace).  Everything here is plain torch code executed on fake tensors, so
the recorded graph holds exactly what PyTorch's own optimizer and loss code dispatch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from graphmem.errors import TraceError, UserInputError

__all__ = ["OPTIMIZERS", "LOSSES", "make_optimizer", "find_logits", "compute_loss", "make_targets"]

# name -> factory(params) built from the real torch.optim classes with their defaults.
OPTIMIZERS: dict[str, Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None] = {
    "sgd": lambda params: torch.optim.SGD(params),
    "sgd-momentum": lambda params: torch.optim.SGD(params, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params),
    "adamw": lambda params: torch.optim.AdamW(params),
    "none": None,
}

LOSSES = ("auto", "sum", "mean", "cross_entropy", "nll")


def make_optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
    """Build the optimizer ``name`` over ``params`` (None for ``"none"``)."""
    if name not in OPTIMIZERS:
        raise UserInputError(f"unknown optimizer {name!r}; expected one of: {', '.join(OPTIMIZERS)}")
    factory = OPTIMIZERS[name]
    if factory is None:
        return None
    if not params:
        raise UserInputError("the model has no trainable parameters; use --mode inference "
                             "or --optimizer none")
    return factory(params)


def find_logits(output: Any) -> torch.Tensor:
    """The first floating-point tensor in the model's output (tuples, dicts, dataclasses)."""
    if hasattr(output, "to_tuple"):  # transformers' ModelOutput
        output = output.to_tuple()
    leaves, _ = tree_flatten(output)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf
    raise TraceError(f"the model's output ({type(output).__name__}) holds no floating-point "
                     "tensor to compute a loss from; return the logits or pass --mode inference")


def make_targets(logits: torch.Tensor) -> torch.Tensor:
    """Class-index targets for cross_entropy / nll: int64 zeros shaped like logits[..., 0]."""
    return torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)


def compute_loss(kind: str, output: Any, targets: torch.Tensor | None) -> torch.Tensor:
    """The scalar loss of ``output``: see ``--loss`` (auto, sum, mean, cross_entropy, nll)."""
    if kind == "auto":
        loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            return loss
        return find_logits(output).sum()
    logits = find_logits(output)
    if kind == "sum":
        return logits.sum()
    if kind == "mean":
        return logits.mean()
    assert targets is not None, f"compute_loss: {kind} needs targets"
    flat = logits.reshape(-1, logits.shape[-1])
    if kind == "cross_entropy":
        return F.cross_entropy(flat, targets.reshape(-1))
    if kind == "nll":
        return F.nll_loss(flat, targets.reshape(-1))
    raise UserInputError(f"unknown loss {kind!r}; expected one of: {', '.join(LOSSES)}")
