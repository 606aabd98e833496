"""The step's optimizer and loss, built from a job's StepConfig.  Everything here is plain
torch code executed on fake tensors, so the recorded graph holds exactly what PyTorch's own
optimizer, autocast and loss code dispatch."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from graphmem.errors import TraceError, UnsupportedError, UserInputError
from graphmem.job.step import OPTIMIZER_IMPLS, StepConfig, resolve_optimizer

__all__ = ["make_optimizer", "find_logits", "compute_loss", "make_targets"]


def make_optimizer(config: StepConfig, params: list[torch.nn.Parameter], *, zero: bool = False
                   ) -> torch.optim.Optimizer | None:
    """Build the step's optimizer over ``params`` (None for ``"none"``); with ``zero``, the
    same optimizer inside torch.distributed's ZeroRedundancyOptimizer (needs a process group)."""
    if config.optimizer == "none":
        return None
    if not params:
        raise UserInputError("the model has no trainable parameters; use --mode inference "
                             "or --optimizer none")
    cls, kwargs = resolve_optimizer(config.optimizer)
    if cls is torch.optim.LBFGS:
        raise UnsupportedError("LBFGS cannot be recorded: its step re-evaluates the loss and branches "
                               "on loss and gradient values, which fake tensors do not have")
    accepted = inspect.signature(cls.__init__).parameters
    for key in OPTIMIZER_IMPLS[config.optimizer_impl]:
        if key not in accepted:
            raise UserInputError(f"{cls.__name__} has no {config.optimizer_impl} implementation; "
                                 f"use --optimizer-impl auto or for-loop")
    kwargs.update(OPTIMIZER_IMPLS[config.optimizer_impl], **config.optimizer_kwargs)
    try:
        if zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
        return cls(params, **kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise UserInputError(f"building {cls.__name__}(**{kwargs!r}) failed: {exc}; "
                             "check --optimizer-kwargs") from exc


def find_logits(output: Any) -> torch.Tensor:
    """The first floating-point tensor in the model's output (tuples, dicts, ModelOutput)."""
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
    return F.nll_loss(flat, targets.reshape(-1))
