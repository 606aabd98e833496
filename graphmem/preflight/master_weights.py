"""bf16 weights with fp32 master weights, as mixed-precision trainers hold them: the optimizer
that the plan's mixed-precision row analyses.

Input: the model's (bf16) parameters and the name of the optimizer to run.  Output: a
``torch.optim.Optimizer`` that graphmem records like any other (the plan selects it by its
import path, ``MASTER_WEIGHTS_OPTIMIZER``), so every byte of the procedure is analysed, not
estimated.

The procedure (Micikevicius et al., "Mixed Precision Training", ICLR 2018, section 3.1; apex
amp O2's ``model_grads_to_master_grads`` / ``master_params_to_model_params``; DeepSpeed's
BF16_Optimizer):
  - when the optimizer is built, an fp32 copy of every parameter (the master weights); the
    optimizer (AdamW, ...) and its state are built over those copies, so its state is fp32;
  - forward and backward run on the bf16 parameters: bf16 activations and bf16 gradients;
  - at the step, each bf16 gradient is copied to an fp32 gradient of its master and freed
    (DeepSpeed's ``clear_lp_grads``), the optimizer updates the masters in fp32, the fp32
    gradients are freed and the masters are copied back into the bf16 parameters.
Bytes per parameter: 2 (bf16) + 4 (master) + the optimizer's fp32 state (8 for Adam), and
at the step 4 more for the fp32 gradients.

Knows nothing of graphmem: plain torch code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from graphmem.job.step import resolve_optimizer

__all__ = ["MASTER_WEIGHTS_OPTIMIZER", "MasterWeights"]

MASTER_WEIGHTS_OPTIMIZER = f"{__name__}:MasterWeights"


class MasterWeights(torch.optim.Optimizer):
    """``inner`` (an optimizer name such as ``"adamw"``) over fp32 master copies of ``params``.

    Its ``state[p]`` of a model parameter ``p`` holds the master copy (``"master"``) and the
    inner optimizer's state of it, so a trainer (and graphmem) sees them as optimizer state.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], inner: str = "adamw", *, foreach: bool | None = None,
                 fused: bool | None = None, **inner_kwargs: Any) -> None:
        self.model_params = list(params)
        with torch.no_grad():
            self.masters = [p.detach().to(torch.float32, copy=True).requires_grad_(True) for p in self.model_params]
        cls, defaults = resolve_optimizer(inner)
        impl = {key: value for key, value in (("foreach", foreach), ("fused", fused)) if value is not None}
        self.inner = cls(self.masters, **{**defaults, **impl, **inner_kwargs})
        super().__init__(self.model_params, {})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        # fp32 gradients of the masters; each bf16 gradient is freed once copied
        for p, master in zip(self.model_params, self.masters, strict=True):
            master.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None
        self.inner.step()
        # the updated masters back into the bf16 parameters; the fp32 gradients are freed
        for p, master in zip(self.model_params, self.masters, strict=True):
            master.grad = None
            p.copy_(master)
        for p, master in zip(self.model_params, self.masters, strict=True):
            self.state[p] = {"master": master, **self.inner.state.get(master, {})}
