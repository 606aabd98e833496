"""The mse_loss rule against the real CPU kernel: the output's dtype and the bytes of its
storage (the reduced loss keeps the broadcast buffer), for mixed dtypes and every reduction."""

from __future__ import annotations

import pytest
import torch

from graphmem.trace.rules.loss import mse_loss_output
from graphmem.trace.rules.registry import ArgMeta


def _meta(t: torch.Tensor) -> ArgMeta:
    return ArgMeta(tuple(t.shape), t.dtype, tuple(t.stride()))


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize(("input_", "target"), [
    (torch.randn(8, 16), torch.randn(8, 16)),
    (torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(8, 16)),  # a bf16 output against fp32 targets
    (torch.randn(8, 16), torch.randn(8, 16, dtype=torch.float16)),
    (torch.randn(8, 16, dtype=torch.bfloat16), torch.tensor(0.5)),  # a 0-dim target keeps the input's dtype
    (torch.randn(4, 1, 16), torch.randn(3, 16)),  # broadcast
], ids=["fp32", "bf16-fp32", "fp32-fp16", "bf16-scalar", "broadcast"])
def test_mse_loss_output_is_what_the_kernel_allocates(input_: torch.Tensor, target: torch.Tensor,
                                                      reduction: int) -> None:
    real = torch.ops.aten.mse_loss.default(input_, target, reduction)
    predicted = mse_loss_output((_meta(input_), _meta(target), reduction), {})
    assert predicted.shape == tuple(real.shape) and predicted.dtype == real.dtype
    numel = predicted.storage_numel if predicted.storage_numel is not None else real.numel()
    assert numel * predicted.dtype.itemsize == real.untyped_storage().nbytes()
