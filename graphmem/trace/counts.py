"""At most how many nonzero elements a mask the model builds can hold.  Used by stage 2 (trace).

A value-dependent size is recorded at its bound (graphmem.trace.rules.bounds): ``nonzero`` of
a mask keeps at most every element.  Some masks are built so that fewer can be set: a
sampler starts from zeros and sets the k elements it picked (``mask = zeros_like(x);
mask[idx] = 1``, torchvision's detection samplers, 512 of 2,000 proposals), and the union of
two such masks holds at most the sum.  This pass follows those counts through the few ops
that build and combine masks, so ``nonzero`` of such a mask is bounded by what was set, not
by its size.  A tensor not followed here has no count (its bound stays its size).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from graphmem.trace._torch_api import hint_of

__all__ = ["NonzeroCounts"]

aten = torch.ops.aten
_ZEROS = frozenset({aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.zero_.default})
_FILLS = frozenset({aten.full.default, aten.full_like.default, aten.new_full.default, aten.fill_.Scalar})
_INDEX_PUTS = frozenset({aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default})
_UNIONS = frozenset({aten.bitwise_or.Tensor, aten.logical_or.default, aten.add.Tensor})
# the same elements, or the same values in another dtype or layout: the count carries over
_SAME = frozenset({aten._to_copy.default, aten.clone.default, aten.view.default, aten._unsafe_view.default,
                   aten.reshape.default, aten.alias.default, aten.detach.default, aten.squeeze.dim,
                   aten.unsqueeze.default, aten.flatten.using_ints, aten.ne.Scalar, aten.gt.Scalar})
_FOLLOWED = _ZEROS | _FILLS | _INDEX_PUTS | _UNIONS | _SAME | {aten.cat.default}


class NonzeroCounts:
    """The most nonzero elements of the masks followed so far (fake tensors, by identity)."""

    def __init__(self) -> None:
        self._most: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def most(self, t: Any) -> int | None:
        """At most how many elements of ``t`` are nonzero; None: not known (up to its size)."""
        return self._most.get(t) if isinstance(t, torch.Tensor) else None

    def propagate(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Follow the count through ``func`` when it is one of the ops above."""
        if func not in _FOLLOWED:  # every recorded op passes here: most are none of these
            return
        count = self._count(func, args, kwargs)
        if count is not None and isinstance(out, torch.Tensor):
            self._most[out] = min(count, hint_of(out.numel()))

    def _count(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        if func in _ZEROS:
            return 0
        if func in _FILLS:
            value = args[-1] if func is not aten.full.default else args[1]
            return 0 if isinstance(value, (int, float, bool)) and value == 0 else None
        if func in _INDEX_PUTS:
            before = self.most(args[0])
            indices = args[1]
            if before is None or any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                return None
            shapes = [tuple(hint_of(d) for d in i.shape) for i in indices if i is not None]
            return before + math.prod(torch.broadcast_shapes(*shapes)) if shapes else None
        if func in _UNIONS:
            counts = [self.most(t) for t in args[:2]]
            return None if None in counts else sum(c for c in counts if c is not None)
        if func == aten.cat.default:
            counts = [self.most(t) for t in args[0]]
            return None if None in counts else sum(c for c in counts if c is not None)
        if func in _SAME:
            if func in (aten.ne.Scalar, aten.gt.Scalar) and args[1] != 0:
                return None
            return self.most(args[0])
        return None
