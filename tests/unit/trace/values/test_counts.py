"""graphmem.trace.values.counts: the most nonzero elements of a mask, followed op by op as the
recorder hands them over (``propagate(op, args, kwargs, out)``), on empty tensors standing for
the fake ones: no op runs, each count is derived by hand beside it."""

from __future__ import annotations

import torch
from torch.autograd.graph import increment_version

from graphmem.trace.values.counts import NonzeroCounts

aten = torch.ops.aten


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor standing for an op's input or output: only its shape, dtype and identity are read."""
    return torch.empty(shape, dtype=dtype)


def test_a_mask_built_from_zeros_holds_what_was_set() -> None:
    counts, x = NonzeroCounts(), _t(1000)
    mask = _t(1000)
    counts.propagate(aten.zeros_like.default, (x,), {}, mask)
    assert counts.most(mask) == 0  # nothing set yet
    picked, index = _t(1000), _t(512, dtype=torch.int64)
    counts.propagate(aten.index_put.default, (mask, [index], _t()), {}, picked)
    assert counts.most(picked) == 512  # 0 + the 512 positions set
    other, more = _t(1000), _t(1000)
    counts.propagate(aten.zeros.default, ([1000],), {}, other)
    counts.propagate(aten.index_put.default, (other, [_t(300, dtype=torch.int64)], _t()), {}, more)
    union = _t(1000)
    counts.propagate(aten.bitwise_or.Tensor, (picked, more), {}, union)
    assert counts.most(union) == 812  # at most the sum: 512 + 300
    again = _t(1000)
    counts.propagate(aten.add.Tensor, (union, picked), {}, again)
    assert counts.most(again) == 1000  # 812 + 512 = 1324, but 1000 elements is all there are


def test_a_count_carries_through_views_and_a_comparison_with_zero() -> None:
    counts, mask, picked = NonzeroCounts(), _t(30), _t(30)
    counts.propagate(aten.zeros_like.default, (mask,), {}, mask)
    counts.propagate(aten.index_put.default, (mask, [_t(4, dtype=torch.int64)], _t()), {}, picked)
    assert counts.most(picked) == 4  # 4 positions set
    rows, nonzero_mask, compared = _t(6, 5), _t(6, 5, dtype=torch.bool), _t(6, 5, dtype=torch.bool)
    counts.propagate(aten.view.default, (picked, [6, 5]), {}, rows)
    counts.propagate(aten.ne.Scalar, (rows, 0), {}, nonzero_mask)
    counts.propagate(aten.ne.Scalar, (rows, 1), {}, compared)
    assert counts.most(rows) == 4 and counts.most(nonzero_mask) == 4  # the same elements
    assert counts.most(compared) is None  # != 1 holds where the mask is 0: up to its size


def test_setting_whole_rows_of_a_mask_counts_every_element_of_them() -> None:
    counts, mask, picked = NonzeroCounts(), _t(6, 5), _t(6, 5)
    counts.propagate(aten.zeros_like.default, (mask,), {}, mask)
    counts.propagate(aten.index_put.default, (mask, [_t(4, dtype=torch.int64)], _t()), {}, picked)
    assert counts.most(picked) == 20  # mask[i] = 1 with i 4 row numbers sets 4 rows of 5
    column = _t(6, 5)
    counts.propagate(aten.index_put.default, (mask, [None, _t(3, dtype=torch.int64)], _t()), {}, column)
    assert counts.most(column) == 18  # mask[:, j] = 1 with j 3 column numbers sets 3 columns of 6


def test_what_is_not_followed_has_no_count() -> None:
    counts, mask, full, ones = NonzeroCounts(), _t(8), _t(8), _t(8)
    counts.propagate(aten.zeros_like.default, (mask,), {}, mask)
    by_mask = _t(8)
    counts.propagate(aten.index_put.default, (mask, [_t(8, dtype=torch.bool)], _t()), {}, by_mask)
    assert counts.most(by_mask) is None  # a boolean index may set every element
    counts.propagate(aten.full.default, ([8], 0), {}, full)
    counts.propagate(aten.full.default, ([8], 1), {}, ones)
    assert (counts.most(full), counts.most(ones)) == (0, None)  # filled with 0: none; with 1: all of them
    assert counts.most(_t(8)) is None and counts.most(3) is None  # never seen; not a tensor


def test_a_sampler_of_positives_keeps_its_positives_apart() -> None:
    """torchvision's box sampler: at most 128 positives (labels >= 1) and 384 negatives
    (labels == 0) of 2000 proposals; the heads then run on where(labels[sampled] > 0)."""
    counts, labels = NonzeroCounts(), _t(2000, dtype=torch.int64)
    sampled_mask = _t(2000, dtype=torch.uint8)
    counts.propagate(aten.zeros_like.default, (labels,), {}, sampled_mask)
    for compare, value, k in ((aten.ge.Scalar, 1, 128), (aten.eq.Scalar, 0, 384)):
        which, where = _t(2000, dtype=torch.bool), _t(900, 1, dtype=torch.int64)
        counts.propagate(compare, (labels, value), {}, which)  # labels >= 1 (or == 0)
        counts.propagate(aten.nonzero.default, (which,), {}, where)  # its positions, as one column
        column = _t(900, dtype=torch.int64)
        counts.propagate(aten.select.int, (where, 1, 0), {}, column)
        picked = _t(k, dtype=torch.int64)  # k of them drawn
        counts.propagate(aten.index.Tensor, (column, [_t(k, dtype=torch.int64)]), {}, picked)
        after = _t(2000, dtype=torch.uint8)
        counts.propagate(aten.index_put.default, (sampled_mask, [picked], _t()), {}, after)
        sampled_mask = after
    assert counts.most(sampled_mask) == 512  # 128 + 384 set
    rows, row_column = _t(512, 1, dtype=torch.int64), _t(512, dtype=torch.int64)
    counts.propagate(aten.nonzero.default, (sampled_mask,), {}, rows)
    counts.propagate(aten.select.int, (rows, 1, 0), {}, row_column)
    sampled_labels = _t(512, dtype=torch.int64)
    counts.propagate(aten.index.Tensor, (labels, [row_column]), {}, sampled_labels)
    positive = _t(512, dtype=torch.bool)
    counts.propagate(aten.gt.Scalar, (sampled_labels, 0), {}, positive)
    assert counts.most(positive) == 128  # > 0 meets the 128 drawn where labels >= 1, not the 384 where == 0
    negative = _t(512, dtype=torch.bool)
    counts.propagate(aten.le.Scalar, (sampled_labels, 0), {}, negative)
    assert counts.most(negative) == 384  # <= 0 meets only the group where labels == 0


def _positives_of_sampled(counts: NonzeroCounts, labels: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """where(labels[nonzero(sampled)] > 0)'s mask, as the heads build it."""
    n = labels.shape[0]
    rows, row_column, values = _t(n, 1, dtype=torch.int64), _t(n, dtype=torch.int64), _t(n, dtype=torch.int64)
    counts.propagate(aten.nonzero.default, (sampled,), {}, rows)
    counts.propagate(aten.select.int, (rows, 1, 0), {}, row_column)
    counts.propagate(aten.index.Tensor, (labels, [row_column]), {}, values)
    positive = _t(n, dtype=torch.bool)
    counts.propagate(aten.gt.Scalar, (values, 0), {}, positive)
    return positive


def test_a_write_to_the_labels_drops_what_was_known_of_them() -> None:
    counts, labels = NonzeroCounts(), _t(100, dtype=torch.int64)
    which, where, column = _t(100, dtype=torch.bool), _t(100, 1, dtype=torch.int64), _t(100, dtype=torch.int64)
    counts.propagate(aten.ge.Scalar, (labels, 1), {}, which)
    counts.propagate(aten.nonzero.default, (which,), {}, where)
    counts.propagate(aten.select.int, (where, 1, 0), {}, column)
    mask, sampled, picked = _t(100, dtype=torch.uint8), _t(100, dtype=torch.uint8), _t(10, dtype=torch.int64)
    counts.propagate(aten.zeros_like.default, (labels,), {}, mask)
    counts.propagate(aten.index.Tensor, (column, [_t(10, dtype=torch.int64)]), {}, picked)
    counts.propagate(aten.index_put.default, (mask, [picked], _t()), {}, sampled)
    assert counts.most(_positives_of_sampled(counts, labels, sampled)) == 10  # the 10 drawn where labels >= 1
    increment_version(labels)  # the labels written (as autograd counts a write): positions no longer name values
    assert counts.most(_positives_of_sampled(counts, labels, sampled)) is None
    assert counts.most(sampled) == 10  # the mask's own count stands: 10 positions set
