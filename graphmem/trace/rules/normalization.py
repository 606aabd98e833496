"""Rules for normalization ops."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphmem.trace.rules.registry import ArgMeta, RuleKind, register

aten = torch.ops.aten
_LOW = (torch.bfloat16, torch.float16)


@register(aten.native_batch_norm.default, device="cpu", kind=RuleKind.OUTPUT_DTYPES)
def batch_norm_mixed_type_stats(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[int, torch.dtype]:
    """CPU batch norm with a bf16/fp16 input and fp32 weight ("mixed type", as under autocast)
    returns save_mean and save_invstd in the weight's dtype; FakeTensor's decomposition
    returns them in the input's.  Source: aten/src/ATen/native/Normalization.cpp
    (batch_norm_cpu: is_mixed_type -> the parameters' dtype for the saved statistics);
    checked against a real CPU run in tests/unit/trace/rules/test_rules.py."""
    x, weight = args[0], args[1]
    if isinstance(weight, ArgMeta) and x.dtype in _LOW and weight.dtype not in _LOW:
        return {1: weight.dtype, 2: weight.dtype}
    return {}


def _contiguous(shape: tuple[Any, ...], dtype: torch.dtype) -> ArgMeta:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step = step * size
    return ArgMeta(tuple(shape), dtype, tuple(reversed(stride)))


@register(aten.native_layer_norm_backward.default, device="cpu", kind=RuleKind.FAKE_KERNEL)
def layer_norm_backward_contiguous(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[ArgMeta | None, ...]:
    """The gradients of layer norm as the real kernels lay them out: contiguous, whatever the
    input's strides.  Both kernels make the input contiguous first and allocate the gradients
    like it (aten/src/ATen/native/layer_norm.cpp ``layer_norm_backward_cpu`` and
    cuda/layer_norm_kernel.cu ``layer_norm_backward_cuda``: ``input.expect_contiguous()``, then
    ``empty_like(*X, ..., LEGACY_CONTIGUOUS_MEMORY_FORMAT)``); the meta kernel keeps the input's
    strides.  A transposed input (PVTv2's spatial-reduction attention) then got a transposed
    gradient that the next op copied in the recording and not in the real run.  Checked against
    the real CPU kernel in tests/unit/trace/rules/test_rules.py."""
    names = ("grad_out", "input", "normalized_shape", "mean", "rstd", "weight", "bias", "output_mask")
    given = dict(zip(names, args, strict=False)) | dict(kwargs)
    x, weight, bias, mask = given["input"], given["weight"], given["bias"], given["output_mask"]
    grad_input = _contiguous(x.shape, x.dtype) if mask[0] else None
    grad_weight = _contiguous(weight.shape, weight.dtype) if mask[1] and isinstance(weight, ArgMeta) else None
    grad_bias = _contiguous(bias.shape, bias.dtype) if mask[2] and isinstance(bias, ArgMeta) else None
    return grad_input, grad_weight, grad_bias
