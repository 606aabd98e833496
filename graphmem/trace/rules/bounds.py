"""Value-dependent output sizes: the largest outputs ``nonzero``, ``masked_select``,
boolean-mask indexing and the ``unique`` family can return.

Fake tensors do not know values, so these ops have no size to record.  Each rule gives the
op's own limit: ``nonzero`` keeps at most every element of its input, a mask selects at most
all of them, ``unique`` finds at most as many distinct values as elements.  The recorder
records the op at that size, or at a declared fraction of it (``--assume nonzero=0.5``), and
says so in the report: the peak is then an upper bound (memory grows with these sizes).
Output layouts were checked against the real CPU kernels (tests/unit/trace/rules/test_bounds.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphmem.trace.rules.registry import ArgMeta, Bound, RuleKind, register

aten = torch.ops.aten
_MASKS = (torch.bool, torch.uint8)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _dim(args: tuple[Any, ...], kwargs: Mapping[str, Any], position: int, name: str, default: Any) -> Any:
    return args[position] if len(args) > position else kwargs.get(name, default)


@register(aten.nonzero.default, device="any", kind=RuleKind.OUTPUT_BOUNDS)
def nonzero_bound(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Bound:
    """(count, ndim) int64 indices; count at most numel."""
    x: ArgMeta = args[0]
    return Bound(_numel(x.shape), (((None, len(x.shape)), torch.int64),))


@register(aten.masked_select.default, device="any", kind=RuleKind.OUTPUT_BOUNDS)
def masked_select_bound(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Bound:
    """(count,) elements; count at most the numel of self and mask broadcast together."""
    x, mask = args[0], args[1]
    return Bound(_numel(torch.broadcast_shapes(x.shape, mask.shape)), (((None,), x.dtype),))


@register(aten.index.Tensor, device="any", kind=RuleKind.OUTPUT_BOUNDS)
def mask_index_bound(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Bound:
    """``x[mask]``: a boolean index of k dims stands for one integer index of ``count``
    entries over those k dims (count at most the mask's numel); then the usual advanced
    indexing: the broadcast index shape replaces the indexed dims in place when the
    advanced indices are adjacent, else goes first."""
    x: ArgMeta = args[0]
    indices: Sequence[ArgMeta | None] = args[1] if len(args) > 1 else kwargs["indices"]
    masks = [i for i in indices if i is not None and i.dtype in _MASKS]
    if len(masks) != 1:  # two masks broadcast their counts against each other: no single count
        raise NotImplementedError("boolean indexing with more than one mask")
    count = _numel(masks[0].shape)
    advanced: list[tuple[int | None, ...]] = []
    kept_before: list[int] = []
    kept_after: list[int] = []
    positions: list[int] = []
    dim = 0
    for position, index in enumerate(indices):
        if index is None:
            (kept_after if advanced else kept_before).append(x.shape[dim])
            dim += 1
        elif index.dtype in _MASKS:
            advanced.append((None,))
            positions.append(position)
            dim += len(index.shape)
        else:
            advanced.append(tuple(index.shape))
            positions.append(position)
            dim += 1
    rest = list(x.shape[dim:])
    shape = _broadcast_with_count(advanced)
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    out = (*kept_before, *shape, *kept_after, *rest) if adjacent else (*shape, *kept_before, *kept_after, *rest)
    return Bound(count, ((tuple(out), x.dtype),))


def _broadcast_with_count(shapes: list[tuple[int | None, ...]]) -> tuple[int | None, ...]:
    """Broadcast index shapes where None (the mask's count) broadcasts like a size > 1."""
    ndim = max(len(s) for s in shapes)
    out: list[int | None] = []
    for k in range(ndim):
        sizes = {s[k - ndim + len(s)] for s in shapes if k - ndim + len(s) >= 0}
        sizes.discard(1)
        out.append(None if None in sizes else (sizes.pop() if sizes else 1))
    return tuple(out)


@register(aten._unique2.default, device="any", kind=RuleKind.OUTPUT_BOUNDS)
def unique_bound(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Bound:
    """values (count,), inverse (self's shape, or empty), counts (count,) or empty."""
    x: ArgMeta = args[0]
    inverse = _dim(args, kwargs, 2, "return_inverse", False)
    counts = _dim(args, kwargs, 3, "return_counts", False)
    return Bound(_numel(x.shape), (((None,), x.dtype), (tuple(x.shape) if inverse else (0,), torch.int64),
                                   ((None,) if counts else (0,), torch.int64)))


@register(aten.unique_consecutive.default, device="any", kind=RuleKind.OUTPUT_BOUNDS)
def unique_consecutive_bound(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Bound:
    """As ``_unique2`` without ``dim``; as ``unique_dim`` with it."""
    dim = _dim(args, kwargs, 3, "dim", None)
    if dim is not None:
        return _along(args[0], dim)
    x: ArgMeta = args[0]
    inverse = _dim(args, kwargs, 1, "return_inverse", False)
    counts = _dim(args, kwargs, 2, "return_counts", False)
    return Bound(_numel(x.shape), (((None,), x.dtype), (tuple(x.shape) if inverse else (0,), torch.int64),
                                   ((None,) if counts else (0,), torch.int64)))


@register(aten.unique_dim.default, device="any", kind=RuleKind.OUTPUT_BOUNDS)
def unique_dim_bound(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Bound:
    """Distinct slices along ``dim``: at most size(dim)."""
    return _along(args[0], _dim(args, kwargs, 1, "dim", 0))


def _along(x: ArgMeta, dim: int) -> Bound:
    dim = dim % len(x.shape)
    values = tuple(None if k == dim else n for k, n in enumerate(x.shape))
    return Bound(x.shape[dim], ((values, x.dtype), ((x.shape[dim],), torch.int64), ((None,), torch.int64)))


@register("torchvision::nms.default", device="any", kind=RuleKind.OUTPUT_BOUNDS)
def nms_bound(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Bound:
    """torchvision's non-maximum suppression: (count,) int64 indices of the boxes kept, count at
    most the number of boxes (every box kept: none overlaps another past the threshold).
    Detection models (Faster/Mask R-CNN, RetinaNet, SSD, FCOS) call it through batched_nms."""
    boxes: ArgMeta = args[0]
    return Bound(boxes.shape[0], (((None,), torch.int64),))
