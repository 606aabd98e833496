"""The step's optimizer and loss, built from a job's StepConfig.  Everything here is plain
torch code executed on fake tensors, so the recorded graph holds exactly what PyTorch's own
optimizer, autocast and loss code dispatch."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from graphmem._torch_api import tree_flatten
from graphmem.errors import TraceError, UnsupportedError, UserInputError
from graphmem.job.option import spelling
from graphmem.job.step import OPTIMIZER_IMPLS, StepConfig, resolve_optimizer, split_save
from graphmem.trace.rules import ops

__all__ = ["make_optimizer", "find_logits", "compute_loss", "loss_taken", "make_targets", "selective_policy"]


def make_optimizer(config: StepConfig, params: list[torch.nn.Parameter], *, zero: bool = False
                   ) -> torch.optim.Optimizer | None:
    """Build the step's optimizer over ``params`` (None for ``"none"``); with ``zero``, the
    same optimizer inside torch.distributed's ZeroRedundancyOptimizer (needs a process group)."""
    if config.optimizer == "none":
        return None
    if not params:
        raise UserInputError(f"the model has no trainable parameters; use {spelling('mode')} inference "
                             f"or {spelling('optimizer')} none")
    cls, kwargs = resolve_optimizer(config.optimizer)
    if cls is torch.optim.LBFGS:
        raise UnsupportedError("LBFGS cannot be recorded: its step re-evaluates the loss and branches "
                               "on loss and gradient values, which fake tensors do not have")
    accepted = inspect.signature(cls.__init__).parameters
    for key in OPTIMIZER_IMPLS[config.optimizer_impl]:
        if key not in accepted:
            raise UserInputError(f"{cls.__name__} has no {config.optimizer_impl} implementation; "
                                 f"use {spelling('optimizer_impl')} auto or for-loop")
    kwargs.update(OPTIMIZER_IMPLS[config.optimizer_impl], **config.optimizer_kwargs)
    try:
        if zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
        return cls(params, **kwargs)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise UserInputError(f"building {cls.__name__}(**{kwargs!r}) failed: {exc}; "
                             f"check {spelling('optimizer_kwargs')}") from exc


def find_logits(output: Any) -> torch.Tensor:
    """The first floating-point tensor in the model's output (tuples, dicts, ModelOutput)."""
    if hasattr(output, "to_tuple"):  # transformers' ModelOutput
        output = output.to_tuple()
    leaves, _ = tree_flatten(output)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf
    raise TraceError(f"the model's output ({type(output).__name__}) holds no floating-point "
                     f"tensor to compute a loss from; return the logits or pass {spelling('mode')} inference")


def _losses(output: Any) -> bool:
    """Whether ``output`` is a dict of scalar losses (``{"loss_classifier": ..., ...}``)."""
    return isinstance(output, dict) and bool(output) and all(
        isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point() for v in output.values())


def make_targets(logits: torch.Tensor) -> torch.Tensor:
    """Class-index targets for cross_entropy / nll: int64 zeros shaped like logits[..., 0]."""
    return torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)


def loss_taken(kind: str, output: Any) -> str:
    """Which loss ``compute_loss(kind, output, ...)`` takes: ``kind`` itself, or for ``auto``
    ``output.loss`` (the model's own), ``losses`` (the sum of a dict of losses) or ``output``
    (the sum of its output): what the report names."""
    if kind != "auto":
        return kind
    if isinstance(getattr(output, "loss", None), torch.Tensor):
        return "output.loss"
    return "losses" if _losses(output) else "output"


def compute_loss(kind: str, output: Any, targets: torch.Tensor | None) -> torch.Tensor:
    """The scalar loss of ``output``: see ``--loss`` (auto, sum, mean, cross_entropy, nll)."""
    if kind == "auto":
        loss = getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            return loss
        if _losses(output):  # a dict of losses (torchvision's detection models): their sum, as trainers take it
            total: torch.Tensor = sum(output.values())
            return total
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


def _packets(names: Sequence[str]) -> frozenset[Any]:
    found = set()
    for name in names:
        packet = getattr(torch.ops.aten, name.removeprefix("aten."), None)
        if packet is None:
            raise UserInputError(f"{spelling('checkpoint_save')}: no op {name!r} in this torch")
        found.add(packet)
    return frozenset(found)


def selective_policy(save: Sequence[str], inside: Mapping[str, Sequence[int]] | None = None) -> Callable[[], Any]:
    """The ``context_fn`` of torch.utils.checkpoint that saves the outputs of the ``save`` ops
    (``matmuls``, ``every-2nd-matmul``, ``attention`` or aten op names) and recomputes the rest,
    with torch's own create_selective_checkpoint_contexts.  A name ``PATH:NAME`` keeps them only
    while the block's submodule at PATH runs: ``inside[PATH]`` is a one-item counter of its
    forwards running (checkpointing.py keeps it, in forward and in the recompute alike)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    matmuls = ops.MATMULS
    anywhere = [n for n in save if not split_save(n)[0]]
    every_second = "every-2nd-matmul" in anywhere
    chosen = _chosen_packets(anywhere)
    scoped = [((inside or {})[path], _chosen_packets([kind])) for path, kind in map(split_save, save) if path]

    def make() -> Any:
        counts = {"forward": 0, "recompute": 0}  # matmuls seen by this checkpoint call

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            packet = op.overloadpacket
            if every_second and packet in matmuls:
                mode = "recompute" if ctx.is_recompute else "forward"
                counts[mode] += 1
                if counts[mode] % 2 == 0:
                    return CheckpointPolicy.MUST_SAVE
            if packet in chosen or any(running[0] and packet in packets for running, packets in scoped):
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return make


def _chosen_packets(names: Sequence[str]) -> frozenset[Any]:
    """The aten packets ``names`` keep: ``matmuls``, ``attention`` and aten op names."""
    chosen = set(_packets([n for n in names if n.startswith("aten.")]))
    if "matmuls" in names:
        chosen |= ops.MATMULS
    if "attention" in names:
        chosen |= ops.ATTENTION
    return frozenset(chosen)
