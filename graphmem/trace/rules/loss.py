"""Rules for losses: CTC's output sizes depend on values (speech recognition heads); MSE's
reduced loss keeps the unreduced buffer as its storage."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphmem.trace.rules.registry import ArgMeta, RuleKind, register

aten = torch.ops.aten


def _contiguous(shape: tuple[int, ...], dtype: torch.dtype) -> ArgMeta:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return ArgMeta(shape, dtype, tuple(reversed(strides)))


@register(aten._ctc_loss.Tensor, device="any", kind=RuleKind.VALUE_KERNEL)
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


@register(aten.mse_loss.default, device="cpu", kind=RuleKind.FAKE_KERNEL)
def mse_loss_output(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> ArgMeta:
    """``mse_loss``: a structured kernel whose meta function (aten/src/ATen/native/Loss.cpp,
    TORCH_META_FUNC(mse_loss)) builds the output as the broadcast of input and target, then,
    for a mean or sum, ``resize_({})``: the 0-d loss keeps that whole storage (measured: a mean
    over 16x256 float32 holds 16,384 bytes).  Its dtype is input's and target's promoted, as a
    binary op's (a bfloat16 output against float32 targets gives a float32 loss).  Every device
    runs this meta function."""
    input_, target = args[0], args[1]
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    shape = tuple(torch.broadcast_shapes(input_.shape, target.shape))
    # only the dimension count and dtype choose the result type: empty stand-ins of that many dims
    dtype = torch.result_type(*(torch.empty((1,) * len(a.shape), dtype=a.dtype, device="meta")
                                for a in (input_, target)))
    if reduction == 0:
        return _contiguous(shape, dtype)
    numel = 1
    for n in shape:
        numel *= n
    return ArgMeta((), dtype, (), storage_numel=numel)
