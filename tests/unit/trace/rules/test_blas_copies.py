"""The operand copies CUDA's matmuls make before calling cuBLAS (graphmem/trace/rules/blas.py),
by hand from aten/src/ATen/native/cuda/Blas.cpp: an operand is used in place when it is dense
(contiguous or transposed) or row/column-major with a valid leading dimension; otherwise it is
cloned contiguous for the call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphmem
from graphmem.records import Phase
from graphmem.trace.rules import rules_for
from graphmem.trace.rules.registry import ArgMeta

aten = torch.ops.aten
CUDA = rules_for("cuda").scratch


def _meta(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype = torch.float16) -> ArgMeta:
    return ArgMeta(shape, dtype, stride)


WEIGHT = _meta((30522, 768), (768, 1))
EXPANDED = _meta((1024, 30522), (0, 0))  # the gradient of logits.sum(), viewed as 2-D


@pytest.mark.parametrize("operand, copied", [
    (_meta((1024, 30522), (30522, 1)), 0),                  # contiguous
    (_meta((1024, 30522), (1, 1024)), 0),                   # transposed (column-major)
    (_meta((1024, 100), (30522, 1)), 0),                    # a column slice: row-major, leading dim 30522 >= 100
    (_meta((100, 1024), (1, 30522)), 0),                    # its transpose: column-major
    (EXPANDED, 1024 * 30522 * 2),                           # every stride 0: copied whole, 62,509,056 B
    (_meta((1024, 768), (0, 1)), 1024 * 768 * 2),           # a row broadcast: row stride 0 < 768 columns
    (_meta((1024, 768), (1536, 2)), 1024 * 768 * 2),        # every other column: no unit stride
])
def test_mm_copies_an_operand_cublas_cannot_read(operand: ArgMeta, copied: int) -> None:
    rule = CUDA[aten.mm.default]
    assert rule((operand, _meta((operand.shape[1], 8), (8, 1))), {}) == copied
    assert rule((_meta((8, operand.shape[0]), (operand.shape[0], 1)), operand), {}) == copied


def test_both_operands_of_one_call_are_copied_together() -> None:
    # grad.t() @ input: the expanded gradient transposed (still every stride 0) and a broadcast input
    rule = CUDA[aten.mm.default]
    assert rule((_meta((30522, 1024), (0, 0)), _meta((1024, 768), (0, 1))), {}) == 1024 * 30522 * 2 + 1024 * 768 * 2


def test_addmm_bias_needs_no_copy() -> None:
    bias = _meta((30522,), (1,))
    assert CUDA[aten.addmm.default]((bias, _meta((1024, 768), (768, 1)), WEIGHT.__class__(
        (768, 30522), torch.float16, (1, 768))), {}) == 0
    assert CUDA[aten.addmm.default]((bias, EXPANDED, _meta((30522, 768), (768, 1))), {}) == 1024 * 30522 * 2


@pytest.mark.parametrize("batch1, batch2, copied", [
    (_meta((48, 256, 64), (16384, 64, 1)), _meta((48, 64, 256), (16384, 256, 1)), 0),  # both contiguous
    (_meta((48, 256, 64), (16384, 64, 1)), _meta((48, 64, 256), (16384, 1, 64)), 0),  # k transposed
    (_meta((48, 256, 64), (0, 64, 1)), _meta((48, 64, 256), (16384, 256, 1)), 0),     # a batch broadcast is fine
    (_meta((48, 256, 64), (16384, 0, 0)), _meta((48, 64, 256), (16384, 256, 1)), 48 * 256 * 64 * 2),
    (_meta((48, 256, 1), (256, 1, 1)), _meta((48, 1, 1), (1, 1, 1)), 0),              # one column: not transposed
])
def test_bmm_copies_by_the_batched_rule(batch1: ArgMeta, batch2: ArgMeta, copied: int) -> None:
    assert CUDA[aten.bmm.default]((batch1, batch2), {}) == copied
    self = _meta((batch1.shape[0], batch1.shape[1], batch2.shape[2]), (0, 0, 0))
    assert CUDA[aten.baddbmm.default]((self, batch1, batch2), {}) == copied


def test_no_copy_rule_on_the_cpu_target() -> None:
    assert aten.mm.default not in rules_for("cpu").scratch


class Head(nn.Module):
    """A language-model head: 4 x 16 tokens of width 32 onto 1000 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 1000, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def test_the_sum_losss_gradient_is_copied_by_the_backward_matmul() -> None:
    """loss = logits.sum(): the weight's gradient (the input needs none) is one matmul per
    iteration, and each copies the 64 x 1000 fp32 gradient (256,000 B), which a fake tensor
    never allocates."""
    report = graphmem.analyze(Head, ["4x16x32"], mode="train", loss="sum", optimizer="sgd", device="cuda")
    assert report.train is not None
    backward = [op for op in report.train.trace.ops if op.phase == Phase.BACKWARD and op.op == "aten.mm.default"]
    assert [op.scratch_bytes for op in backward] == [64 * 1000 * 4] * 2  # two iterations
