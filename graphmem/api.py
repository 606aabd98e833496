"""analyze(): the stages in order — load, trace, liveness, memory model — nothing else."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphmem.errors import UserInputError
from graphmem.liveness import POLICIES, compute_lifetimes
from graphmem.load import ModelSource, build_model, resolve_target
from graphmem.memory import build_mode_report
from graphmem.rules import Rule, rules_for
from graphmem.spec import InputSpec, parse_input_spec
from graphmem.step import LOSSES, OPTIMIZERS
from graphmem.trace import trace_step
from graphmem.types import MemoryReport, ModeReport

__all__ = ["analyze", "ANALYSIS_MODES", "DEVICES"]

ANALYSIS_MODES = ("both", "train", "inference")
DEVICES = ("cpu",)


def analyze(model: str | ModelSource, inputs: Sequence[InputSpec | str], *,
            mode: str = "both", optimizer: str = "adam", loss: str = "auto",
            device: str = "cpu", dtype: torch.dtype | None = None,
            kwargs: Mapping[str, Any] | None = None,
            rules: Mapping[torch._ops.OpOverload, Rule] | None = None,
            policy: str = "observed") -> MemoryReport:
    """Predict the memory of one inference call and of a training step, without running them.

    Args:
        model: ``"pkg.module:Attr"`` / ``"file.py:Attr"``, an nn.Module class, a factory
            returning an nn.Module, or an nn.Module instance (left untouched).
        inputs: example inputs as ``InputSpec`` or ``"[NAME=]DIMS[:DTYPE]"`` strings.
        mode: ``"both"``, ``"train"`` or ``"inference"``.
        optimizer: ``sgd``, ``sgd-momentum``, ``adam``, ``adamw`` or ``none`` (train only).
        loss: ``auto``, ``sum``, ``mean``, ``cross_entropy`` or ``nll`` (train only).
        device: target device; ``"cpu"``: bytes as PyTorch's CPU execution allocates them.
        dtype: convert the model's floating parameters and buffers (``model.to(dtype)``).
        kwargs: keyword arguments for the model class or factory.
        rules: extra per-op scratch rules, overriding the registry's for ``device``.
        policy: storage release policy, ``"observed"`` or ``"last_use"`` (see liveness).

    Returns:
        A MemoryReport; ``inference`` / ``train`` are None when not asked for.  Sizes in bytes.

    Known limitations:
        Memory a kernel allocates internally without dispatching an op (workspaces) is not
        seen unless a rule in ``graphmem.rules`` models it.  Values are never known: code that
        branches on tensor values raises TraceError.  Ops whose meta kernels return other
        strides than the real kernel can shift a gradient copy (seen: LSTM's mkldnn backward).
    """
    specs = _validate(inputs, mode, optimizer, loss, device, policy)
    source = resolve_target(model) if isinstance(model, str) else model
    module = build_model(source, kwargs)
    table = rules_for(device, rules)
    reports: dict[str, ModeReport] = {}
    for m in ("inference", "train"):
        if mode in (m, "both"):
            trace = trace_step(module, specs, mode=m, optimizer=optimizer, loss=loss,
                               device=device, dtype=dtype, rules=table)
            lifetimes = compute_lifetimes(trace, policy)
            reports[m] = build_mode_report(trace, lifetimes, {str(op) for op in table})
    name = model if isinstance(model, str) else getattr(model, "__qualname__", type(model).__name__)
    return MemoryReport(target=name, device=device, inputs=tuple(str(s) for s in specs),
                        inference=reports.get("inference"), train=reports.get("train"))


def _validate(inputs: Sequence[InputSpec | str], mode: str, optimizer: str, loss: str,
              device: str, policy: str) -> list[InputSpec]:
    """Check every option before anything is imported or traced."""
    for value, choices, what in ((mode, ANALYSIS_MODES, "mode"), (optimizer, tuple(OPTIMIZERS), "optimizer"),
                                 (loss, LOSSES, "loss"), (device, DEVICES, "device"),
                                 (policy, POLICIES, "policy")):
        if value not in choices:
            raise UserInputError(f"unknown {what} {value!r}; expected one of: {', '.join(choices)}")
    if isinstance(inputs, (str, InputSpec)):
        inputs = [inputs]
    specs = [s if isinstance(s, InputSpec) else parse_input_spec(s) for s in inputs]
    if not specs:
        raise UserInputError("no input given; pass at least one --input such as 32x1000")
    return specs
