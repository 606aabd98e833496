"""At most how many nonzero elements a mask the model builds can hold.  Used by stage 2 (trace).

A value-dependent size is recorded at its bound (graphmem.trace.rules.bounds): ``nonzero`` of
a mask keeps at most every element.  Some masks are built so that fewer can be set: a
sampler starts from zeros and sets the k elements it picked (``mask = zeros_like(x);
mask[idx] = 1``, torchvision's detection samplers, 512 of 2,000 proposals), and the union of
two such masks holds at most the sum.  This pass follows those counts through the few ops
that build and combine masks, so ``nonzero`` of such a mask is bounded by what was set, not
by its size.  A tensor not followed here has no count (its bound stays its size).

It also follows *which* elements a sampler picked, for the one question a detection model's
heads ask next.  torchvision's box sampler takes at most 128 positives (labels >= 1) and
fills up to 512 with negatives (labels == 0); the mask and keypoint heads then run on
``where(labels[sampled] > 0)``: at most the 128 positives, though the sampled rows number
512.  So the pass keeps, for 1-D integer tensors only:

* a comparison with a number (``labels >= 1``): the positions of ``labels`` whose values
  lie in a range;
* indices of such positions (``nonzero`` of that comparison, and any selection of them);
* for a mask built from zeros by setting such indices, the pieces that cover its set
  elements: at most k of them, at positions whose values lie in a range (and ``nonzero``
  of it: the same, as distinct positions);
* ``labels[those indices]``: values in groups, at most k of them in each group's range.

A comparison of such values counts only the groups whose range it can meet.  Each fact
names the tensor it reads, as it was (its version): a write to it since drops the fact.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from graphmem._torch_api import hint_of, op_schema, version_of
from graphmem.trace.rules import ops

aten = torch.ops.aten

__all__ = ["NonzeroCounts"]

_FOLLOWED = (ops.ZEROS | ops.FILLS | ops.INDEX_PUTS | ops.UNIONS | ops.SAME_ELEMENTS | ops.COLUMNS
             | {aten.cat.default, aten.index.Tensor, *ops.COMPARISONS})

_Range = tuple[float, float]  # integers lo..hi, either end possibly infinite


@dataclass(frozen=True, slots=True)
class _Positions:
    """Positions of the 1-D integer tensor ``base`` (as it was at ``version``) whose values lie
    in ``values``."""

    base: weakref.ref[torch.Tensor]
    version: int
    values: _Range

    def of(self, t: torch.Tensor) -> bool:
        """Whether these are positions of ``t`` as it is now."""
        return self.base() is t and version_of(t) == self.version


def _meets(a: _Range, b: _Range) -> bool:
    return max(a[0], b[0]) <= min(a[1], b[1])


def _version_after(func: Any, t: torch.Tensor) -> int:
    """``t``'s version once ``func`` returns: autograd counts an in-place write after the op."""
    return version_of(t) + (1 if op_schema(func).is_mutable else 0)


class NonzeroCounts:
    """The most nonzero elements of the masks followed so far (fake tensors, by identity)."""

    def __init__(self) -> None:
        self._most: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # tensor -> (fact, its version when the fact was made); see the module's docstring
        self._compared: WeakIdKeyDictionary = WeakIdKeyDictionary()  # mask -> _Positions it is true at
        self._points: WeakIdKeyDictionary = WeakIdKeyDictionary()  # indices -> _Positions
        self._pieces: WeakIdKeyDictionary = WeakIdKeyDictionary()  # mask or its indices -> ((k, _Positions), ...)
        self._parts: WeakIdKeyDictionary = WeakIdKeyDictionary()  # values -> ((k, _Range), ...)

    def weak_tables(self) -> list[WeakIdKeyDictionary]:
        """The tables that hold tensors by weak reference (graphmem.trace.core.recorder's swap)."""
        return [self._most, self._compared, self._points, self._pieces, self._parts]

    def most(self, t: Any) -> int | None:
        """At most how many elements of ``t`` are nonzero; None: not known (up to its size)."""
        return self._most.get(t) if isinstance(t, torch.Tensor) else None

    def propagate(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Follow the count through ``func`` when it is one of the ops above."""
        if func not in _FOLLOWED:  # every recorded op passes here: most are none of these
            return
        count = self._count(func, args, kwargs)
        self._follow(func, args, out, count)
        if isinstance(out, torch.Tensor):
            by_value = self._by_value(func, args)
            counts = [c for c in (count, by_value) if c is not None]
            if counts:
                self._most[out] = min(*counts, hint_of(out.numel()))

    def _count(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        if func in ops.ZEROS:
            return 0
        if func in ops.FILLS:
            value = args[-1] if func is not aten.full.default else args[1]
            return 0 if isinstance(value, (int, float, bool)) and value == 0 else None
        if func in ops.INDEX_PUTS:
            before = self.most(args[0])
            indices = args[1]
            if before is None or any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                return None
            shapes = [tuple(hint_of(d) for d in i.shape) for i in indices if i is not None]
            if not shapes:
                return None
            # each index sets the whole of the dimensions it leaves out: mask[rows] = 1 sets rows x columns
            whole = [hint_of(d) for k, d in enumerate(args[0].shape) if k >= len(indices) or indices[k] is None]
            return before + int(math.prod(torch.broadcast_shapes(*shapes))) * math.prod(whole)
        if func in ops.UNIONS:
            counts = [self.most(t) for t in args[:2]]
            return None if None in counts else sum(c for c in counts if c is not None)
        if func == aten.cat.default:
            counts = [self.most(t) for t in args[0]]
            return None if None in counts else sum(c for c in counts if c is not None)
        if func in ops.SAME_ELEMENTS:
            if func in (aten.ne.Scalar, aten.gt.Scalar) and args[1] != 0:
                return None
            return self.most(args[0])
        return None

    # -- which elements: positions, pieces and parts ------------------------------------------
    def _get(self, facts: WeakIdKeyDictionary, t: Any) -> Any:
        """The fact ``facts`` holds on ``t``, if ``t`` was not written since."""
        if not isinstance(t, torch.Tensor):
            return None
        found = facts.get(t)
        return found[0] if found is not None and found[1] == version_of(t) else None

    def _by_value(self, func: Any, args: tuple[Any, ...]) -> int | None:
        """A comparison of values in groups: the groups whose range it can meet."""
        parts = self._get(self._parts, args[0]) if func in ops.COMPARISONS else None
        if parts is None or not _integer_comparison(args):
            return None
        wanted = ops.COMPARISONS[func](args[1])
        return int(sum(k for k, values in parts if _meets(values, wanted)))

    def _follow(self, func: Any, args: tuple[Any, ...], out: Any, count: int | None) -> None:
        x: Any = args[0] if args else None
        if func in ops.COMPARISONS and _integer_comparison(args) and x.dim() == 1:
            positions = _Positions(weakref.ref(x), version_of(x), ops.COMPARISONS[func](args[1]))
            self._set(self._compared, func, out, positions)
        elif func in ops.COLUMNS:
            self._columns(func, args, out)
        elif func == aten.index.Tensor:
            self._select(func, args, out)
        elif (func in ops.ZEROS or func in ops.FILLS) and count == 0:  # nothing set yet
            self._set(self._pieces, func, out, ())
        elif func in ops.INDEX_PUTS:
            self._set(self._pieces, func, out, self._put(args))
        elif func in ops.UNIONS:
            pieces = [self._get(self._pieces, t) for t in args[:2]]
            self._set(self._pieces, func, out, None if None in pieces else pieces[0] + pieces[1])
        elif func == aten.cat.default:
            parts = [self._get(self._parts, t) for t in args[0]]
            self._set(self._parts, func, out, None if None in parts else sum(parts, ()))
        if func in ops.COPIES and isinstance(out, torch.Tensor):
            self._set(self._parts, func, out, self._get(self._parts, x))
            if tuple(out.shape) == tuple(x.shape):  # the same positions
                for facts in (self._points, self._pieces):
                    self._set(facts, func, out, self._get(facts, x))
        elif func in (aten.ne.Scalar, aten.gt.Scalar) and args[1] == 0:  # set where the mask is (or fewer)
            self._set(self._pieces, func, out, self._get(self._pieces, x))

    def _set(self, facts: WeakIdKeyDictionary, func: Any, out: Any, fact: Any) -> None:
        if not isinstance(out, torch.Tensor):
            return
        if fact is None:
            facts.pop(out, None)
        else:
            facts[out] = (fact, _version_after(func, out))

    def _columns(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        """nonzero of a 1-D mask, then its one column: the positions it is set at."""
        x = args[0]
        if func == aten.nonzero.default:
            if x.dim() != 1:
                return
            self._set(self._points, func, out, self._get(self._compared, x))
            self._set(self._pieces, func, out, self._get(self._pieces, x))
            return
        dim = args[1] if len(args) > 1 else 0  # (a dim given by keyword: not followed)
        if x.dim() != 2 or hint_of(x.shape[1]) != 1 or dim not in (1, -1):
            return
        column = out[0] if func == aten.unbind.int else out
        for facts in (self._points, self._pieces):
            self._set(facts, func, column, self._get(facts, x))

    def _select(self, func: Any, args: tuple[Any, ...], out: Any) -> None:
        """``x[i]``: a selection of positions is positions; ``base[positions]`` are values in groups."""
        indices = args[1]
        if len(indices) != 1 or indices[0] is None or indices[0].dtype in (torch.bool, torch.uint8):
            return
        x, i = args[0], indices[0]
        self._set(self._points, func, out, self._get(self._points, x))
        pieces = self._get(self._pieces, i)
        if pieces is not None and all(where.of(x) for _, where in pieces):
            self._set(self._parts, func, out, tuple((k, where.values) for k, where in pieces))

    def _put(self, args: tuple[Any, ...]) -> tuple[tuple[int, _Positions], ...] | None:
        """The pieces of a mask after ``mask[i] = v``, where ``i`` are known positions."""
        before, indices = self._get(self._pieces, args[0]), args[1]
        if before is None or len(indices) != 1 or indices[0] is None or args[0].dim() != 1:
            return None
        where = self._get(self._points, indices[0])
        return None if where is None else (*before, (hint_of(indices[0].numel()), where))


def _integer_comparison(args: tuple[Any, ...]) -> bool:
    """A tensor of integers compared with an integer."""
    return (len(args) > 1 and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point()
            and args[0].dtype not in (torch.bool, torch.complex64, torch.complex128)
            and isinstance(args[1], int) and not isinstance(args[1], bool))
