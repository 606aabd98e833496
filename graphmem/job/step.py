"""How the training step runs: its configuration, the optimizers and losses a job can name."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from graphmem.errors import UserInputError
from graphmem.job.choices import LOSSES, OPTIMIZER_CHOICES, OPTIMIZER_IMPLS, OPTIMIZERS
from graphmem.job.optim_formula import FORMULA_OPTIMIZERS

__all__ = ["StepConfig", "OPTIMIZERS", "OPTIMIZER_CHOICES", "OPTIMIZER_IMPLS", "LOSSES", "AMP_DTYPES",
           "SAVE_CHOICES", "resolve_optimizer", "split_save"]

# --checkpoint-save: the outputs kept by selective activation checkpointing
SAVE_CHOICES = {
    "matmuls": "every matrix multiply (mm, addmm, bmm, baddbmm)",
    "every-2nd-matmul": "every second matrix multiply of a block's forward (torchtitan's op policy)",
    "attention": "the scaled-dot-product attention kernels",
}


def split_save(name: str) -> tuple[str, str]:
    """A ``--checkpoint-save`` name as (submodule path inside the block, what it keeps):
    ``"attn.proj:matmuls"`` -> ``("attn.proj", "matmuls")``, ``"matmuls"`` -> ``("", "matmuls")``."""
    path, _, kind = name.rpartition(":")
    return path, kind


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class StepConfig:
    """How the training step runs.

    Attributes:
        optimizer: a name from OPTIMIZER_CHOICES, or ``pkg.module:Class`` of a
            ``torch.optim.Optimizer`` subclass.
        optimizer_kwargs: extra keyword arguments for the optimizer.
        optimizer_impl: ``auto``, ``for-loop``, ``foreach`` or ``fused``.
        loss: a name from LOSSES.
        amp: None, ``"bf16"`` or ``"fp16"``: torch.autocast around forward and loss
            (fp16 adds a torch.amp.GradScaler).
        checkpoint: class names whose modules run under non-reentrant torch.utils.checkpoint.
        checkpoint_every: checkpoint only every k-th of those modules (the 1st, k+1-th, ...).
        checkpoint_blocks: checkpoint only these of those modules (0-based, in the model's
            order: ``model.modules()``), in place of every k-th; empty: every k-th.  What
            ``graphmem plan --policy`` chooses block by block.
        checkpoint_save_blocks: with ``checkpoint_save`` and ``checkpoint_blocks``: only these of
            the chosen blocks keep the ``checkpoint_save`` outputs (selective), the others are
            checkpointed whole; empty: every checkpointed block is selective.
        checkpoint_save: selective checkpointing: inside a checkpointed module, the outputs of
            these ops are saved and every other op is recomputed in backward (names from
            SAVE_CHOICES or aten op names such as ``aten.mm``, each either for the whole block or,
            as ``PATH:NAME``, only for the ops run inside the block's submodule at PATH, e.g.
            ``attn.proj:matmuls``); empty: recompute everything.
        checkpoint_save_in: per block, its own ``checkpoint_save`` names: (block, names) pairs,
            the blocks among ``checkpoint_blocks`` (what ``plan --policy`` chooses op by op).
        grad_accum: micro-steps (forward + backward) per optimizer step.
        iterations: optimizer steps recorded (2: the first creates the optimizer state).
    """

    optimizer: str = "adam"
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    optimizer_impl: str = "auto"
    loss: str = "auto"
    amp: str | None = None
    checkpoint: tuple[str, ...] = ()
    checkpoint_every: int = 1
    checkpoint_save: tuple[str, ...] = ()
    checkpoint_blocks: tuple[int, ...] = ()
    checkpoint_save_blocks: tuple[int, ...] = ()
    checkpoint_save_in: tuple[tuple[int, tuple[str, ...]], ...] = ()
    grad_accum: int = 1
    iterations: int = 2

    def validate(self) -> None:
        """Raise UserInputError for any invalid field, before anything is traced."""
        if self.optimizer not in OPTIMIZER_CHOICES and ":" not in self.optimizer:
            raise UserInputError(f"unknown optimizer {self.optimizer!r}; expected one of: "
                                 f"{', '.join(OPTIMIZER_CHOICES)}, or pkg.module:Class")
        for value, choices, what in ((self.optimizer_impl, tuple(OPTIMIZER_IMPLS), "optimizer-impl"),
                                     (self.loss, LOSSES, "loss"),
                                     (self.amp or "bf16", tuple(AMP_DTYPES), "amp")):
            if value not in choices:
                raise UserInputError(f"unknown {what} {value!r}; expected one of: {', '.join(choices)}")
        if (self.checkpoint_every != 1 or self.checkpoint_save or self.checkpoint_blocks) and not self.checkpoint:
            raise UserInputError("--checkpoint-every, --checkpoint-blocks and --checkpoint-save refine --checkpoint "
                                 "CLASS; give the class of the blocks to checkpoint too")
        if self.checkpoint_blocks and self.checkpoint_every != 1:
            raise UserInputError("--checkpoint-blocks names the blocks to checkpoint; --checkpoint-every picks "
                                 "every k-th: give one of them")
        if self.checkpoint_save_blocks and not (self.checkpoint_save and set(self.checkpoint_save_blocks)
                                                <= set(self.checkpoint_blocks)):
            raise UserInputError("--checkpoint-save-blocks names which of the --checkpoint-blocks keep the "
                                 "--checkpoint-save outputs: give both, and only blocks among --checkpoint-blocks")
        if any(b < 0 for b in self.checkpoint_blocks) or len(set(self.checkpoint_blocks)) != len(
                self.checkpoint_blocks):
            raise UserInputError(f"--checkpoint-blocks: block indices must be distinct and >= 0, got "
                                 f"{','.join(map(str, self.checkpoint_blocks))}")
        if self.checkpoint_every < 1:
            raise UserInputError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        names = [*self.checkpoint_save, *(n for _, saved in self.checkpoint_save_in for n in saved)]
        kinds = {n: split_save(n)[1] for n in names}
        unknown = [n for n, kind in kinds.items() if kind not in SAVE_CHOICES and not kind.startswith("aten.")]
        if unknown:
            raise UserInputError(f"--checkpoint-save: unknown {', '.join(unknown)}; expected "
                                 f"{', '.join(SAVE_CHOICES)} or aten op names such as aten.mm, each optionally "
                                 "after a submodule path inside the block (attn.proj:matmuls)")
        own = [b for b, _ in self.checkpoint_save_in]
        if own and not (set(own) <= set(self.checkpoint_blocks) and len(set(own)) == len(own)):
            raise UserInputError("--checkpoint-save-in names blocks among --checkpoint-blocks, each once, "
                                 "with the outputs each keeps (0=attn.proj:matmuls)")
        if self.grad_accum < 1 or self.iterations < 1:
            raise UserInputError(f"grad-accum and iterations must be >= 1, got {self.grad_accum} "
                                 f"and {self.iterations}")


def resolve_optimizer(name: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and its default kwargs for a name or ``pkg.module:Class``."""
    if name in OPTIMIZERS:
        cls_name, defaults = OPTIMIZERS[name]
        return getattr(torch.optim, cls_name), dict(defaults)
    if name in FORMULA_OPTIMIZERS:
        return FORMULA_OPTIMIZERS[name], {}
    module_name, _, attr = name.rpartition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UserInputError(f"cannot load optimizer {name!r}: {exc}; give pkg.module:Class") from exc
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise UserInputError(f"{name!r} is not a torch.optim.Optimizer subclass")
    return cls, {}
