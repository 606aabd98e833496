"""Rules for normalization ops."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphmem.trace.rules.registry import ArgMeta, register

aten = torch.ops.aten
_LOW = (torch.bfloat16, torch.float16)


@register(aten.native_batch_norm.default, device="cpu", kind="output_dtypes")
def batch_norm_mixed_type_stats(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[int, torch.dtype]:
    """CPU batch norm with a bf16/fp16 input and fp32 weight ("mixed type", as under autocast)
    returns save_mean and save_invstd in the weight's dtype; FakeTensor's decomposition
    returns them in the input's.  Source: aten/src/ATen/native/Normalization.cpp
    (batch_norm_cpu: is_mixed_type -> the parameters' dtype for the saved statistics);
    checked against a real CPU run in tests/unit/test_rules.py."""
    x, weight = args[0], args[1]
    if isinstance(weight, ArgMeta) and x.dtype in _LOW and weight.dtype not in _LOW:
        return {1: weight.dtype, 2: weight.dtype}
    return {}
