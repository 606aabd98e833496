"""Named groups of ops: every set of aten ops the recorder and its passes treat alike, in one
place (after tinygrad's ``GroupOp``).  Real op objects, never names: a group that names an op
this torch lacks fails at import, not by silently never matching.

Overloads (``aten.mm.default``) where the pass compares the op itself; packets (``aten.mm``)
where it compares ``op.overloadpacket`` (every overload alike).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from graphmem._torch_api import OpOverload

__all__ = ["ATTENTION", "CHOICES", "COLUMNS", "COMPARISONS", "COPIES", "FILLS", "FINITE_CHECKS", "INDEX_PUTS", "LIFTS",
           "MATMULS", "NONZERO", "OVERWRITES", "READ", "REPEAT_BY_VALUES", "SAME_ELEMENTS", "SIZE_QUERIES", "SUM",
           "UNIFORM_DRAWS", "UNIONS", "ZEROS"]

aten = torch.ops.aten

# -- the recorder -------------------------------------------------------------------
READ = aten._local_scalar_dense.default  # .item(), and every other read of one value
# FakeTensorMode turns a real constant (torch.tensor(1.0)) into a fake copy through these; in a
# real run input and output are one tensor, so only the output is counted.
LIFTS = frozenset({aten.lift_fresh.default, aten.lift.default})
# size queries that reach the mode when sizes are symbols (graphmem.trace.symbolic): no
# tensor, no memory, and not dispatched at all when sizes are numbers, so never recorded
SIZE_QUERIES = frozenset(getattr(packet, overload) for packet in (
    aten.size, aten.stride, aten.numel, aten.storage_offset,
    aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset)
    for overload in packet.overloads())

# -- value answers (graphmem.trace.values) ------------------------------------------------
REPEAT_BY_VALUES = aten.repeat_interleave.Tensor  # no bound: as long as the sum of its repeats
SUM = aten.sum.default
NONZERO = aten.nonzero.default
# uniform draws in [0, 1) (packets): a model that reads one decides at random (LayerDrop skips
# a layer when torch.rand() < its rate)
UNIFORM_DRAWS = frozenset({aten.rand, aten.rand_like})
# checks for NaN and inf (packets) -> the answer on finite values
FINITE_CHECKS = {aten.isnan: False, aten.isinf: False, aten.isposinf: False, aten.isneginf: False}
# in-place ops that overwrite every value of their tensor without reading it (packets): its
# values afterwards are known whatever it held (a DataLoader's first random number: torch.empty(()).random_())
OVERWRITES = frozenset({aten.random_, aten.uniform_, aten.normal_, aten.bernoulli_, aten.exponential_,
                        aten.geometric_, aten.log_normal_, aten.cauchy_, aten.fill_, aten.zero_})
# choices made from values (an MoE router's torch.topk / argmax of its scores): where no shadow
# knows the values, their indices are taken as --assume routing=uneven|balanced spreads them
CHOICES = frozenset({aten.topk.default, aten.argmax.default, aten.argmin.default, aten.max.dim, aten.min.dim})

# -- masks built and combined (graphmem.trace.values.counts) ------------------------------
ZEROS = frozenset({aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.zero_.default})
FILLS = frozenset({aten.full.default, aten.full_like.default, aten.new_full.default, aten.fill_.Scalar})
INDEX_PUTS = frozenset({aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default})
UNIONS = frozenset({aten.bitwise_or.Tensor, aten.logical_or.default, aten.add.Tensor})
# the same elements, or the same values in another dtype or layout: a mask's count carries over
SAME_ELEMENTS = frozenset({aten._to_copy.default, aten.clone.default, aten.view.default, aten._unsafe_view.default,
                           aten.reshape.default, aten.alias.default, aten.detach.default, aten.squeeze.dim,
                           aten.unsqueeze.default, aten.flatten.using_ints, aten.ne.Scalar, aten.gt.Scalar})
COPIES = SAME_ELEMENTS - {aten.ne.Scalar, aten.gt.Scalar}  # the same values, not a comparison of them
# a comparison with the integer c, as the range of integers it holds for
_INF = math.inf
COMPARISONS: dict[OpOverload, Callable[[int], tuple[float, float]]] = {
    aten.ge.Scalar: lambda c: (c, _INF), aten.gt.Scalar: lambda c: (c + 1, _INF), aten.eq.Scalar: lambda c: (c, c),
    aten.le.Scalar: lambda c: (-_INF, c), aten.lt.Scalar: lambda c: (-_INF, c - 1)}
# the indices of a 1-D tensor's nonzero elements: nonzero gives them as one column, unbind or
# select takes it out
COLUMNS = frozenset({aten.nonzero.default, aten.unbind.int, aten.select.int})

# -- selective activation checkpointing (graphmem.trace.step.optim), packets ------------------
MATMULS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm})
ATTENTION = frozenset(getattr(aten, name) for name in (  # the kernels this torch has
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(aten, name))
