"""The values an optimizer step reads, from a real run on one-element parameters.

Used by stage 2 (trace).  Fake tensors hold no values, but some optimizer code branches on
values it reads with ``.item()``: ASGD's ``mu`` decides between ``copy_`` and an update that
allocates temporaries, GradScaler's ``found_inf`` decides whether the step runs at all.
These values depend on the step count and hyper-parameters, not on the parameters' sizes, so
graphmem runs the same optimizer for real on parameters shaped ``[1] * ndim`` (a few bytes
each) with zero gradients (finite: no inf/NaN) and records every value read, in order.  The
trace then serves the fake step's reads from that list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphmem._torch_api import TorchDispatchMode
from graphmem.job.step import StepConfig
from graphmem.trace.rules import ops
from graphmem.trace.step.optim import make_optimizer

__all__ = ["ValueReads", "optimizer_scalar_reads"]



class ValueReads(TorchDispatchMode):
    """Collects the values a real optimizer step reads (``.item()``), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.values: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func == ops.READ:
            self.values.append(out)
        return out


def optimizer_scalar_reads(param_ndims: Sequence[int], step: StepConfig, device: str) -> list[Any]:
    """Every value the optimizer step reads with ``.item()``, over ``step.iterations`` steps.

    Args:
        param_ndims: the number of dimensions of each trainable parameter, in order.
        step: the step configuration (optimizer, its kwargs and implementation, amp).
        device: the target device type; the replica runs on CPU, with a GradScaler for that
            device type when ``step.amp == "fp16"``.
    """
    params = [torch.nn.Parameter(torch.zeros([1] * ndim)) for ndim in param_ndims]
    opt = make_optimizer(step, params)
    if opt is None:
        return []
    scaler = torch.amp.GradScaler("cpu", enabled=True) if step.amp == "fp16" else None
    reads = ValueReads()
    with reads:
        for _ in range(step.iterations):
            for p in params:
                p.grad = torch.zeros_like(p)
            if scaler is not None:
                scaler.scale(torch.zeros(()))
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
    return reads.values
