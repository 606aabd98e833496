"""How the training step runs: its configuration, the optimizers and losses a job can name."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from graphmem.errors import UserInputError
from graphmem.job.choices import LOSSES, OPTIMIZER_CHOICES, OPTIMIZER_IMPLS, OPTIMIZERS
from graphmem.job.optim_formula import FORMULA_OPTIMIZERS
from graphmem.job.step_config import SAVE_CHOICES, StepConfig, split_save

__all__ = ["StepConfig", "OPTIMIZERS", "OPTIMIZER_CHOICES", "OPTIMIZER_IMPLS", "LOSSES", "AMP_DTYPES",
           "SAVE_CHOICES", "resolve_optimizer", "split_save"]

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
