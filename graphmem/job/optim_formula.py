"""Optimizers that cannot run here, sized by formula: bitsandbytes' 8-bit optimizers.

bitsandbytes' kernels need CUDA, so their step cannot be recorded.  These stand-ins are
``torch.optim.Optimizer`` subclasses whose ``step()`` only creates the state tensors the
real optimizer would hold (lazily, at the first step, like the real one) and updates
nothing.  The report labels their optimizer state as coming from a formula.

The formula, from bitsandbytes ``optim/optimizer.py`` (``Optimizer2State.init_state`` /
``Optimizer1State.init_state``):
  - a parameter with fewer than ``min_8bit_size`` (4096) elements keeps 32-bit state:
    4 bytes per element per state;
  - otherwise each state is 1 byte (uint8) per element, plus one float32 ``absmax`` per
    block of ``blocksize`` elements (block-wise quantization; 256 in bitsandbytes >= 0.44,
    2048 before: an assumption you can change with ``--optimizer-kwargs '{"blocksize": 2048}'``).
  - the 256-entry quantization maps are shared by all parameters and are not counted.
The step's own temporaries (the fused 8-bit kernels work in registers) are taken as zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["FORMULA_OPTIMIZERS", "eight_bit_state_bytes"]


def eight_bit_state_bytes(numel: int, states: int, *, min_8bit_size: int = 4096, blocksize: int = 256) -> int:
    """Bytes of state bitsandbytes keeps for one parameter of ``numel`` elements."""
    if numel < min_8bit_size:
        return states * 4 * numel
    return states * (numel + 4 * math.ceil(numel / blocksize))


class _EightBitFormula(torch.optim.Optimizer):
    """Creates bitsandbytes-sized state at the first step; updates nothing."""

    states = 2

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, min_8bit_size: int = 4096,
                 blocksize: int = 256, **ignored: Any) -> None:
        super().__init__(params, {"lr": lr, "min_8bit_size": min_8bit_size, "blocksize": blocksize})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or p in self.state:
                    continue
                self.state[p] = self._init_state(p, group["min_8bit_size"], group["blocksize"])

    def _init_state(self, p: torch.Tensor, min_8bit_size: int, blocksize: int) -> dict[str, torch.Tensor]:
        n = p.numel()
        names = [f"state{i + 1}" for i in range(self.states)]
        if n < min_8bit_size:
            return {name: torch.zeros_like(p, dtype=torch.float32) for name in names}
        state = {name: torch.zeros(n, dtype=torch.uint8, device=p.device) for name in names}
        blocks = math.ceil(n / blocksize)
        for i in range(self.states):
            state[f"absmax{i + 1}"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        return state


class _EightBitOneState(_EightBitFormula):
    states = 1


FORMULA_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam8bit": _EightBitFormula,
    "adamw8bit": _EightBitFormula,
    "paged-adamw8bit": _EightBitFormula,
    "lion8bit": _EightBitOneState,
    "sgd8bit-momentum": _EightBitOneState,
}
