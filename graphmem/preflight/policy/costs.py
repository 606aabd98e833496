"""What recomputing an op costs: the objective ``plan --policy`` minimises.

Input: an analysed step (``ModeReport``) and the ``CostModel``.  Output: each op's cost, by op
index.  Pure.

Two models.  FLOPs, by torch.utils.flop_counter's formulas (the CPU target, and GPUs whose peak
rates graphmem does not hold): an op without a formula (a layer norm, an activation, an addition)
costs nothing.  On the CUDA target with a GPU of ``graphmem.cuda.gpus.ROOFLINES``, a roofline
estimate of the op's time in nanoseconds: its FLOPs at the matrix units' dense 16-bit rate (a
bf16/fp16 matmul or attention) or at the fp32 rate, or the bytes of the storages it reads and of
those it makes at the memory bandwidth, whichever takes longer.  A view makes no storage and
costs nothing.  So an elementwise op's recompute, free by FLOPs, costs its memory traffic: what
a selectively checkpointed block re-runs is no longer free.  The estimate ignores caches, kernel
launch overheads and fusion; it ranks choices, and each choice's peak is still analysed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from graphmem.cuda.gpus import ROOFLINES, Roofline
from graphmem.memory.results import ModeReport

__all__ = ["FLOPS", "CostModel", "cost_model"]

_SIXTEEN_BITS = ("torch.bfloat16", "torch.float16", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class CostModel:
    """FLOPs (``roofline`` None), or a roofline time on ``gpu``."""

    roofline: Roofline | None = None
    gpu: str = ""

    @property
    def unit(self) -> str:
        return "FLOPs" if self.roofline is None else "ns"

    def describe(self) -> str:
        """The model in words, for the report."""
        r = self.roofline
        if r is None:
            return "FLOPs (torch.utils.flop_counter's formulas)"
        return (f"a roofline estimate of each op's time on {self.gpu}: its FLOPs at {r.matrix_16bit_tflops:g} "
                f"TFLOPS (bf16/fp16 matmuls and attention) or {r.fp32_tflops:g} TFLOPS, or the bytes it reads and "
                f"makes at {r.bandwidth_gbs:,.0f} GB/s, whichever takes longer ({r.source})")

    def op_costs(self, mode: ModeReport) -> list[int]:
        """Each op's cost, by its index in ``mode``'s trace."""
        ops = mode.trace.ops
        r = self.roofline
        if r is None:
            return [op.flops for op in ops]
        storages = {s.sid: s for s in mode.trace.storages}
        costs = []
        for op in ops:
            made = [storages[sid] for sid in op.outputs if sid in storages and storages[sid].created == op.index]
            if not made and not op.flops:
                costs.append(0)
                continue
            moved = sum(storages[sid].nbytes for sid in set(op.inputs) if sid in storages)
            moved += sum(s.nbytes for s in made)
            matrix = op.flops and made and made[0].dtype in _SIXTEEN_BITS
            rate = (r.matrix_16bit_tflops if matrix else r.fp32_tflops) * 1e12
            costs.append(math.ceil(max(op.flops / rate, moved / (r.bandwidth_gbs * 1e9)) * 1e9))
        return costs

    def recompute(self, mode: ModeReport) -> int:
        """The cost of the ops activation checkpointing re-runs in ``mode`` (both iterations)."""
        return sum(cost for op, cost in zip(mode.trace.ops, self.op_costs(mode), strict=True) if op.recompute)


FLOPS = CostModel()


def cost_model(device: str, gpu: str | None) -> CostModel:
    """The roofline on the CUDA target where ``gpu``'s peak rates are known, else FLOPs."""
    if device != "cuda" or gpu is None:
        return FLOPS
    from graphmem.cuda.gpus import get_gpu

    preset = get_gpu(gpu)
    roofline = ROOFLINES.get(preset.name)
    return FLOPS if roofline is None else CostModel(roofline, preset.name)
