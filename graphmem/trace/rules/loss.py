"""Rules for losses whose output sizes depend on values: CTC (speech recognition heads)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphmem.trace.rules.registry import ArgMeta, register

aten = torch.ops.aten


def _contiguous(shape: tuple[int, ...], dtype: torch.dtype) -> ArgMeta:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return ArgMeta(shape, dtype, tuple(reversed(strides)))


@register(aten._ctc_loss.Tensor, device="any", kind="value_kernel")
def ctc_loss_outputs(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[ArgMeta, ArgMeta] | None:
    """CTC loss with the lengths as tensors (what ``F.ctc_loss`` calls): the per-sample loss
    (batch,) and the forward variables log_alpha (batch, T, 2 x longest target + 1), as
    aten/src/ATen/native/LossCTC.cpp (and LossCTC.cu) allocate them.  The longest target
    comes from ``target_lengths``' values (the model computes them from the labels)."""
    log_probs, target_lengths = args[0], args[3] if len(args) > 3 else kwargs.get("target_lengths")
    if not isinstance(target_lengths, torch.Tensor) or not isinstance(log_probs, ArgMeta) \
            or len(log_probs.shape) != 3:
        return None
    longest = int(target_lengths.max()) if target_lengths.numel() else 0
    frames, batch = log_probs.shape[0], log_probs.shape[1]
    return (_contiguous((batch,), log_probs.dtype),
            _contiguous((batch, frames, 2 * longest + 1), log_probs.dtype))
