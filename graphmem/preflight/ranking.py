"""How ``graphmem plan`` orders its remedies: one rule, defined here and nowhere else.

Input: the remedies' changes (plain data: what each row changes in the job) and their
predictions.  Output: how far each one departs from the training the user asked for, and the
ranked rows.  Pure; knows nothing of analysis or rendering.

The rule, first key first (docs/preflight.md, "Ranking", gives the reasons):
  1. rows that fit before rows that do not;
  2. rows that keep the training's math before rows that depart from it.  Kept: the same math
     (implementation, checkpointing, accumulation, sharding, offload) and mixed precision
     (autocast; bf16 weights with fp32 master weights: the update stays fp32, as every current
     trainer runs it).  Departing, nearest first (``Departure``): BatchNorm statistics over
     smaller micro-batches, weights and optimizer state kept in bf16, the same optimizer with
     8-bit state, fewer samples per optimizer step, another optimizer, other weights (pruned,
     smaller, quantized);
  3. effort: a setting, then changing the weights, then more hardware (more GPUs, host memory
     for offload);
  4. the least extra compute per sample;
  5. the nearer departure (the same math before mixed precision);
  6. among rows that fit, the smallest change (the highest peak); among the others, the lowest peak.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import IntEnum, unique
from typing import Any, Protocol, TypeVar

__all__ = ["RANKING_RULE", "Departure", "departure", "effort", "eight_bit_version", "rank_key", "rank_rows"]

# the one sentence the plan prints under its table
RANKING_RULE = ("Ranked: rows that fit first; then rows that keep the job's math (the same math, or mixed "
                "precision with its fp32 update) before rows that depart from it, the nearest first (BatchNorm over "
                "smaller micro-batches < bf16 weights and optimizer state < 8-bit optimizer state < fewer samples "
                "per step < another optimizer < other weights); then by effort (a setting < changing the weights < "
                "more hardware); then by extra compute per sample.")


@unique
class Departure(IntEnum):
    """How far a remedy departs from the training the user asked for (lower: closer)."""

    SAME_MATH = 0          # implementation, checkpointing, accumulation, sharding, offload
    MIXED_PRECISION = 1    # autocast, bf16 weights with fp32 master weights: the update stays fp32
    MICRO_BATCH_NORM = 2   # accumulation: BatchNorm normalises over each micro-batch
    HALF_PRECISION = 3     # weights and optimizer state in bf16/fp16: updates rounded to 16 bits
    QUANTIZED_STATE = 4    # the same optimizer with 8-bit state (bitsandbytes)
    SMALLER_BATCH = 5      # fewer samples per optimizer step
    OTHER_OPTIMIZER = 6    # another algorithm
    OTHER_WEIGHTS = 7      # pruned, smaller or quantized weights (a 4-bit LoRA base too)


# the bitsandbytes 8-bit version of an optimizer: the same update with quantized state
_EIGHT_BIT = {"adam": "adam8bit", "adamw": "adamw8bit", "sgd-momentum": "sgd8bit-momentum"}
_OTHER_WEIGHTS = frozenset({"prune_amount", "prune_remove", "quantize", "sparse", "shrink", "quantize_base"})


def eight_bit_version(optimizer: str) -> str | None:
    """The 8-bit optimizer with ``optimizer``'s update, if bitsandbytes has one."""
    return _EIGHT_BIT.get(optimizer)


def departure(changes: Mapping[str, Any], mode: str = "train", optimizer: str = "", *,
              batch_norm: bool = False) -> Departure:
    """How far ``changes`` depart from the job's training (the farthest of its parts).

    Args:
        changes: a plan row's changes (optimizer, amp, master_weights, dtype, batch, grad_accum, ...).
        mode: "train" or "inference" (bf16 weights in inference are mixed precision's kin: no update).
        optimizer: the job's own optimizer (its 8-bit version is the closest other optimizer).
        batch_norm: the model has BatchNorm layers (accumulation then changes their statistics).
    """
    found = [Departure.SAME_MATH]
    if _OTHER_WEIGHTS & set(changes):
        found.append(Departure.OTHER_WEIGHTS)
    if "optimizer" in changes:
        same = changes["optimizer"] == eight_bit_version(optimizer)
        found.append(Departure.QUANTIZED_STATE if same else Departure.OTHER_OPTIMIZER)
    if "batch" in changes and "grad_accum" not in changes:
        found.append(Departure.SMALLER_BATCH)
    if "grad_accum" in changes and batch_norm:
        found.append(Departure.MICRO_BATCH_NORM)
    if "dtype" in changes and "master_weights" not in changes:
        found.append(Departure.HALF_PRECISION if mode == "train" else Departure.MIXED_PRECISION)
    if "amp" in changes or "master_weights" in changes:
        found.append(Departure.MIXED_PRECISION)
    if "kv_cache" in changes:
        found.append(Departure.MIXED_PRECISION if changes["kv_cache"] == "bfloat16" else Departure.OTHER_WEIGHTS)
    return max(found)


def effort(changes: Mapping[str, Any]) -> int:
    """0: a setting; 1: changes the weights (their dtype, pruning, quantization); 2: needs more
    hardware (more GPUs; host memory and PCIe for offload).  The most any part needs."""
    if {"parallel", "offload"} & set(changes):
        return 2
    return 1 if (_OTHER_WEIGHTS | {"dtype"}) & set(changes) else 0


class _Ranked(Protocol):  # what the rule reads of a row
    @property
    def fits(self) -> bool: ...
    @property
    def departure(self) -> int: ...
    @property
    def effort(self) -> int: ...
    @property
    def extra_compute(self) -> float | None: ...
    @property
    def peak_bytes(self) -> int: ...


_R = TypeVar("_R", bound=_Ranked)


def rank_key(row: _Ranked) -> tuple[bool, int, int, float, int, int]:
    """The sort key of the rule in the module docstring."""
    kept = row.departure <= Departure.MIXED_PRECISION
    return (not row.fits, 0 if kept else row.departure, row.effort, round(row.extra_compute or 0.0, 3),
            row.departure, -row.peak_bytes if row.fits else row.peak_bytes)


def rank_rows(rows: Sequence[_R]) -> list[_R]:
    """The rows, best first (see the module docstring)."""
    return sorted(rows, key=rank_key)
