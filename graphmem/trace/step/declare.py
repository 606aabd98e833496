"""What a recording declares before the step runs: its placeholders, roles and assumed values.

Input: the recorder, the model's (fake) parameters and buffers, the fake inputs with their
specs, and the user's ``Assumptions``.  Output: placeholders in the fx graph, each tensor's
role and name in the recorder's books, the assumed inputs' known values, and for a detection
model trained without targets, the targets graphmem makes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import to_fake
from graphmem.job.assume import Assumptions
from graphmem.job.option import spelling
from graphmem.job.spec import InputSpec
from graphmem.records import Role
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.values.shadows import SAMPLE, TARGETS, default_assumption
from graphmem.trace.values.targets import detection_targets

__all__ = ["declare_inputs", "declare_parameters", "declare_targets", "parameter_names"]


def parameter_names(model: nn.Module) -> dict[torch.Tensor, tuple[str, Role]]:
    """Parameters and buffers after a strategy was applied (a DTensor names its local shard)."""
    names: dict[torch.Tensor, tuple[str, Role]] = {p: (name, Role.PARAMETER) for name, p in model.named_parameters()}
    for name, b in model.named_buffers():
        names.setdefault(b, (name, Role.BUFFER))
    return names


def declare_parameters(recorder: Recorder, names: Mapping[torch.Tensor, tuple[str, Role]],
                       buckets: Sequence[torch.Tensor], values: Mapping[torch.Tensor, torch.Tensor]) -> None:
    """The parameters and buffers as placeholders with their roles; an engine's gradient
    buckets; the values buffers were built with."""
    for tensor, (name, role) in names.items():
        recorder.add_placeholder(tensor, name)
        recorder.mark(tensor, role, name, owner=name)
    for tensor in buckets:
        recorder.mark(tensor, Role.COMMUNICATION, "gradient buckets")
    for tensor, value in values.items():
        recorder.answers.shadows.built(tensor, value)


def declare_inputs(recorder: Recorder, specs: Sequence[InputSpec], args: list[Any],
                   kwargs: dict[str, Any], assume: Assumptions, sample: Mapping[str, torch.Tensor]) -> None:
    """Placeholders, the input role, and the values of inputs: the sample's, else the assumed
    values of integer inputs."""
    names = [s.name or f"input_{i}" for i, s in enumerate(specs)]
    assume.check_names(names)
    positional = iter(args)
    for spec, name in zip(specs, names, strict=True):
        tensor = kwargs[spec.name] if spec.name else next(positional)
        recorder.add_placeholder(tensor, name)
        recorder.mark(tensor, Role.INPUT, name)
        kind = assume.inputs.get(name) or default_assumption(name, spec.dtype)
        if name in sample:
            recorder.answers.shadows.built(tensor, sample[name], SAMPLE)
        elif kind:
            recorder.answers.shadows.assume(tensor, name, kind)


def declare_targets(recorder: Recorder, model: nn.Module, args: list[Any], kwargs: dict[str, Any],
                    fake_mode: Any, device: torch.device, boxes: int) -> None:
    """A detection model trained without targets gets graphmem's (graphmem.trace.values.targets): a
    keyword input ``targets`` of fake tensors whose values are known, noted in the report."""
    real = detection_targets(model, args, kwargs, boxes)
    if real is None:
        return
    fakes: list[dict[str, torch.Tensor]] = []
    for i, target in enumerate(real):
        fakes.append({})
        for key, value in target.items():
            fake = to_fake(fake_mode, torch.empty_like(value, device="meta"), device)
            name = f"targets[{i}].{key}"
            recorder.add_placeholder(fake, name)
            recorder.mark(fake, Role.INPUT, name)
            recorder.answers.shadows.built(fake, value, TARGETS)
            fakes[-1][key] = fake
    kwargs["targets"] = fakes
    parts = ", ".join(k for k in real[0] if k not in ("boxes", "labels"))
    recorder.assumptions.append(
        f"training: no targets were given, so each image gets {boxes} ground-truth boxes (half the image's "
        f"width and height each, on a grid, class 1{', with ' + parts if parts else ''}); {spelling('assume')} boxes=N "
        "changes how many")
