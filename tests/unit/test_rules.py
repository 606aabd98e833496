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
