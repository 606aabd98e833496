"""Formulas for the what-if rows graphmem cannot execute here (pure functions of bytes).

Input: an analysed ModeReport's lifetimes (graphmem's own per-category bytes at every op)
or plain sizes.  Output: int bytes.  Every row built from these is labelled "formula" in
the plan, because nothing of it was recorded: ZeRO/FSDP sharding needs N GPUs and
collectives, CPU offload needs a second device, int8/int4 kernels and sparse layouts are
not what the model runs.

Sources:
  - ZeRO: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models" (SC 2020), section 5 / figure 1: per-device model states are
    (2 + 2 + K)Ψ for data parallelism; stage 1 (P_os) divides optimizer states by N_d,
    stage 2 (P_os+g) also gradients, stage 3 (P_os+g+p) also parameters.  Here each
    category's own bytes (whatever its dtype) are divided, op by op, over the analysed
    step; stage 3 adds the parameters of one gathered unit while forward and backward run
    and that unit's full gradient during backward (FSDP's all-gather / reduce-scatter of one
    wrapped module; the paper's "constant buffer"); communication buffers are not counted.
  - CPU offload (ZeRO-Offload, Ren et al. 2021): optimizer state and the optimizer step
    (its temporaries) move to the CPU; gradients are copied there once per step.
  - int8 weight-only: 1 byte per weight plus one 2-byte scale per output row (per-channel,
    as torchao's int8_weight_only); int4 weight-only: half a byte per weight plus a 2-byte
    scale and a 2-byte zero point per group of ``group_size`` weights of a row (torchao's
    int4_weight_only, default group_size 128).
  - CSR (torch.sparse_csr_tensor): values (nnz x value bytes), column indices (nnz x 8,
    int64) and row pointers ((rows + 1) x 8).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import accumulate

from graphmem.memory.results import Category, Lifetime
from graphmem.records import Phase

__all__ = [
    "Scaling",
    "category_series",
    "csr_break_even_density",
    "csr_bytes",
    "int4_weight_bytes",
    "int8_weight_bytes",
    "offload_scaling",
    "scaled_peak",
    "shrink_scaling",
    "zero_scaling",
]

ONE = Fraction(1)
_RUNS_MODEL = frozenset({Phase.FORWARD, Phase.LOSS, Phase.BACKWARD})


@dataclass(frozen=True, slots=True)
class Scaling:
    """How a formula changes each category's live bytes.

    Attributes:
        factors: multiplier of each category's bytes at every op (missing: 1).
        optimizer_temporaries: multiplier of temporaries while the optimizer step runs.
        extra_bytes: bytes added while an op of the phase runs.
    """

    factors: Mapping[Category, Fraction] = field(default_factory=dict)
    optimizer_temporaries: Fraction = ONE
    extra_bytes: Mapping[Phase, int] = field(default_factory=dict)


def category_series(lifetimes: Sequence[Lifetime], num_ops: int) -> dict[Category, list[int]]:
    """Live bytes per category after every op (index i: after op i)."""
    deltas = {c: [0] * (num_ops + 2) for c in Category}
    # each lifetime adds its bytes from start to end; shifted by one so start -1 fits
    for life in lifetimes:
        deltas[life.category][life.start + 1] += life.nbytes
        deltas[life.category][life.end + 2] -= life.nbytes
    return {c: list(accumulate(d))[1:num_ops + 1] for c, d in deltas.items()}


def scaled_peak(lifetimes: Sequence[Lifetime], phases: Sequence[Phase], scratch: Sequence[int],
                scaling: Scaling) -> int:
    """The peak of live bytes after applying ``scaling`` at every op.

    Args:
        lifetimes: an analysed mode's lifetimes.
        phases: the phase of each op, in order.
        scratch: each op's scratch bytes (counted as temporaries).
        scaling: the formula.

    Returns:
        Bytes, rounded up.
    """
    series = category_series(lifetimes, len(phases))
    peak = Fraction(0)
    for i, phase in enumerate(phases):
        live = Fraction(scaling.extra_bytes.get(phase, 0))
        for category, values in series.items():
            factor = scaling.factors.get(category, ONE)
            if category == Category.TEMPORARY and phase == Phase.OPTIMIZER:
                factor *= scaling.optimizer_temporaries
            live += factor * (values[i] + (scratch[i] if category == Category.TEMPORARY else 0))
        peak = max(peak, live)
    return math.ceil(peak)


def zero_scaling(stage: int, world_size: int, unit_bytes: int) -> Scaling:
    """ZeRO stage 1, 2 or 3 (FSDP FULL_SHARD is stage 3) over ``world_size`` ranks.

    Args:
        unit_bytes: parameter bytes of the largest unit gathered at once (stage 3).
    """
    if stage not in (1, 2, 3) or world_size < 1:
        raise ValueError(f"zero_scaling: stage must be 1, 2 or 3 and world_size >= 1, "
                         f"got {stage}, {world_size}")
    shard = Fraction(1, world_size)
    factors = {Category.OPTIMIZER_STATE: shard}
    if stage >= 2:
        factors[Category.GRADIENT] = shard
    if stage == 3:
        factors[Category.PARAMETER] = shard
    # the optimizer updates only this rank's shard: its temporaries shrink with it
    extra = {} if stage < 3 else {Phase.FORWARD: unit_bytes, Phase.LOSS: unit_bytes,
                                  Phase.BACKWARD: 2 * unit_bytes}
    return Scaling(factors=factors, optimizer_temporaries=shard, extra_bytes=extra)


def offload_scaling() -> Scaling:
    """Optimizer state and the optimizer step on the CPU: neither is on the device."""
    return Scaling(factors={Category.OPTIMIZER_STATE: Fraction(0)}, optimizer_temporaries=Fraction(0))


def shrink_scaling(shrunk_share: Fraction) -> Scaling:
    """Layers made smaller (structured pruning): parameters, gradients and optimizer state
    shrink by ``shrunk_share``; activations are kept as they are (an upper bound)."""
    keep = 1 - shrunk_share
    return Scaling(factors={Category.PARAMETER: keep, Category.GRADIENT: keep,
                            Category.OPTIMIZER_STATE: keep})


def int8_weight_bytes(rows: int, cols: int, scale_bytes: int = 2) -> int:
    """An int8 weight-only quantized (rows x cols) Linear weight with per-row scales."""
    return rows * cols + rows * scale_bytes


def int4_weight_bytes(rows: int, cols: int, group_size: int = 128, scale_bytes: int = 2) -> int:
    """An int4 weight-only quantized (rows x cols) weight: packed nibbles, and a scale and a
    zero point per group of ``group_size`` weights in each row."""
    return math.ceil(rows * cols / 2) + rows * math.ceil(cols / group_size) * 2 * scale_bytes


def csr_bytes(rows: int, cols: int, density: Fraction, value_bytes: int, index_bytes: int = 8) -> int:
    """A (rows x cols) matrix in CSR with ``density`` of its entries kept."""
    nnz = math.ceil(rows * cols * density)
    return nnz * (value_bytes + index_bytes) + (rows + 1) * index_bytes


def csr_break_even_density(value_bytes: int, index_bytes: int = 8) -> Fraction:
    """The density below which CSR is smaller than the dense matrix (row pointers ignored)."""
    return Fraction(value_bytes, value_bytes + index_bytes)

