"""Each registered rule against the real CPU kernel it describes."""

from __future__ import annotations

import pytest
import torch

from graphmem.trace.rules import rules_for
from graphmem.trace.rules.registry import ArgMeta

aten = torch.ops.aten


def _meta(t: torch.Tensor | None) -> ArgMeta | None:
    return None if t is None else ArgMeta(tuple(t.shape), t.dtype, tuple(t.stride()))


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                              (torch.bfloat16, None)])
def test_batch_norm_output_dtypes_match_the_cpu_kernel(x_dtype: torch.dtype, w_dtype: torch.dtype | None) -> None:
    x = torch.randn(2, 4, 3, 3).to(x_dtype)
    params = [torch.ones(4, dtype=w_dtype), torch.zeros(4, dtype=w_dtype), torch.zeros(4, dtype=w_dtype),
              torch.ones(4, dtype=w_dtype)] if w_dtype else [None] * 4
    real = aten.native_batch_norm.default(x, *params, True, 0.1, 1e-5)
    rule = rules_for("cpu").output_dtypes[aten.native_batch_norm.default]
    fixes = rule((_meta(x), *(_meta(p) for p in params), True, 0.1, 1e-5), {})
    for i in (1, 2):
        assert fixes.get(i, x.dtype) == real[i].dtype


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True)])
def test_layer_norm_backward_layout_matches_the_cpu_kernel(transposed: bool, mask: tuple[bool, bool, bool]) -> None:
    """The gradients' shapes, dtypes and strides as the real CPU kernel returns them, for a
    contiguous input and a transposed one (whose meta gradient kept the transposed strides)."""
    x = torch.randn(2, 12, 6).transpose(1, 2) if transposed else torch.randn(2, 6, 12)
    weight, bias = torch.randn(12), torch.randn(12)
    out, mean, rstd = torch.ops.aten.native_layer_norm(x, [12], weight, bias, 1e-5)
    args = (torch.randn_like(out), x, [12], mean, rstd, weight, bias, list(mask))
    real = torch.ops.aten.native_layer_norm_backward(*args)
    meta = lambda t: ArgMeta(tuple(t.shape), t.dtype, tuple(t.stride())) if isinstance(t, torch.Tensor) else t
    rule = rules_for("cpu").fake_kernels[torch.ops.aten.native_layer_norm_backward.default]
    predicted = rule(tuple(meta(a) for a in args), {})
    assert [meta(t) if t is not None else None for t in real] == list(predicted)
