"""Tensor parallelism on fakes: a plan of styles applied by ``parallelize_module``.

Input: a model whose parameters are fake, a ``ParallelSpec`` (its ``tp_plan``, else the
model's own ``base_model_tp_plan``) and the tensor-parallel mesh.  Output: the planned
modules' parameters as DTensors holding this rank's shards, in place.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from graphmem.errors import UserInputError
from graphmem.job.option import spelling
from graphmem.job.parallel import ParallelSpec
from graphmem.trace.distributed.user_code import _import_function

__all__ = ["tp_plan"]


def tp_plan(model: nn.Module, spec: ParallelSpec) -> tuple[nn.Module, dict[str, Any]]:
    """The module the tensor-parallel plan applies to, and the plan (module name -> style)."""
    plan = spec.tp_plan
    if isinstance(plan, str):
        plan = _import_function(plan, f"{spelling('tp_plan')}", "PLAN")
        if not isinstance(plan, Mapping):
            raise UserInputError(f"{spelling('tp_plan')} {spec.tp_plan!r} is not a dict of module name -> style")
    if plan is not None:
        return model, dict(plan)
    config = getattr(model, "config", None)
    declared = getattr(config, "base_model_tp_plan", None)
    if not declared:
        raise UserInputError(f"{spelling('parallel')} tp: {type(model).__name__} has no tensor-parallel plan (no "
                             f"base_model_tp_plan in its config); give one with {spelling('tp_plan')} file.py:PLAN, "
                             "a dict "
                             "such as {'fc1': 'colwise', 'fc2': 'rowwise'}")
    return getattr(model, "base_model", model), dict(declared)


def _tp_style(style: Any) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not isinstance(style, str):
        return style
    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel}
    return styles[style]()


def _tensor_parallel(model: nn.Module, spec: ParallelSpec, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    root, plan = tp_plan(model, spec)
    names = [name for name, _ in root.named_modules()]
    unmatched = [key for key in plan if not any(fnmatch.fnmatch(name, key) for name in names)]
    if unmatched:
        raise UserInputError(f"tensor-parallel plan: no module named {', '.join(unmatched)} in "
                             f"{type(root).__name__}")
    parallelize_module(root, mesh, {key: _tp_style(style) for key, style in plan.items()})
