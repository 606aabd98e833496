"""Known values for the few tensors whose values a model reads.  Used by stage 2 (trace).

Fake tensors hold no values, but some model code reads them: ``if mask.all()``, packed-
sequence checks, ``.item()`` on a position, ``nonzero()`` of a mask (a value-dependent
shape).  graphmem resolves such reads with *declared assumptions* about the inputs: an
integer input named like ``*mask*`` is all ones (no padding), ``position_ids`` counts
0..S-1 along the last dimension, any other integer input is zeros; ``--assume NAME=VALUE``
changes one (``ones``, ``zeros``, ``arange`` or an integer).

Where a size is a symbol (graphmem.trace.symbolic), shadows take its value while recording,
without a guard; a recording whose answers came from shadows then keeps no size formula.

Each assumed input gets a small real *shadow* tensor.  Every op whose tensor arguments all
have shadows (inputs, or tensors computed from them and from constants such as
``torch.arange``) is also run on the shadows, for real, as long as its result has at most
``SHADOW_LIMIT`` elements; so a read of a mask-derived value gets its real answer, and a
value-dependent shape its real shape.  Reads of anything computed from weights or
activations cannot be answered and stop the analysis with a clear message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from graphmem._torch_api import (
    OP_ERRORS,
    generator_started_at,
    hint_of,
    holds_fakes,
    outside_modes,
    tree_flatten,
    tree_map,
    unset_fake_temporarily,
)
from graphmem.job.option import spelling
from graphmem.job.spec import BELOW, ROUTINGS
from graphmem.job.values import UNINITIALISED
from graphmem.trace.rules import ops

__all__ = ["SAMPLE", "Shadows", "default_assumption", "SHADOW_LIMIT", "spread"]

SHADOW_LIMIT = 1 << 20  # elements: a shadow never costs more than a few MiB of real memory
# uniform draws in [0, 1): a model that reads one decides at random (LayerDrop skips a layer
# when torch.rand() < its rate); graphmem answers with the largest value, the same every run,
# so every layer that could be skipped runs: the worst case
RANDOM_DRAW = "a random draw"  # the source of the shadows of ops.UNIFORM_DRAWS' outputs
# checks for NaN and inf (``assert x.isnan().sum() == 0``): a run that trains or infers has none,
# so each answers as on finite values, whatever ``x`` is.  torch.isfinite is no single op (its
# abs, ne, eq, mul run): the tracer marks its output with finite_check itself
FINITE = "finite values"  # the source of the shadows of ops.FINITE_CHECKS' outputs
BUILT = "values computed when built"  # the source of buffers' shadows (graphmem.job.values)
TARGETS = "targets made by graphmem"  # a detection model's targets (graphmem.trace.values.targets; noted there)
PREDICTED_BOXES = "predicted boxes covering the image"  # an R-CNN's boxes, read in inference (trace.targets)
MASK_COUNT = "a mask's count at its most"  # how many elements of a mask of unknown values are set
SAMPLE = "the sample"  # the inputs' own values (--sample)


@dataclass(frozen=True, slots=True)
class _Shadow:
    value: torch.Tensor
    sources: frozenset[str]  # the assumed inputs this value derives from


def default_assumption(name: str, dtype: torch.dtype) -> str | None:
    """What an input is assumed to hold, by name (None: floating inputs get no shadow)."""
    if dtype.is_floating_point or dtype.is_complex:
        return None
    if "mask" in name:
        return "ones"
    return "arange" if name == "position_ids" else "zeros"


def _make(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(shape, dtype=dtype)
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if kind == "arange":
        return torch.arange(shape[-1] if shape else 1, dtype=dtype).expand(shape).contiguous()
    if kind.startswith(BELOW):  # torch.randint(0, N, shape) from a generator started at 0
        return torch.randint(0, int(kind.removeprefix(BELOW)), shape, dtype=dtype, generator=generator_started_at(0))
    return torch.full(shape, int(kind), dtype=dtype)


class Shadows:
    """Real values riding along fake tensors that derive only from assumed inputs."""

    def __init__(self) -> None:
        self._shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()  # fake tensor -> _Shadow
        self.used: set[str] = set()  # assumptions an answer depended on
        self.routing = "uneven"  # how choices from unknown values are spread (choose)
        # a real tensor (data the program loaded, a constant) is its own shadow up to this many
        # elements (None: whatever its size; it is there already, nothing is copied)
        self.real_limit: int | None = SHADOW_LIMIT
        self._unfollowed: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors never given a shadow

    def assume(self, fake: torch.Tensor, name: str, kind: str) -> None:
        """Give input ``fake`` (named ``name``) the value ``kind``."""
        if hint_of(fake.numel()) <= SHADOW_LIMIT:
            with unset_fake_temporarily():
                value = _make(kind, tuple(hint_of(d) for d in fake.shape), fake.dtype)
            self._shadows[fake] = _Shadow(value, frozenset({f"{name}={kind}"}))

    def built(self, fake: torch.Tensor, value: torch.Tensor, source: str = BUILT) -> None:
        """``fake`` holds ``value``: a buffer computed when the model was built (``BUILT``), a
        target graphmem made (``TARGETS``), or a box taken as the whole image (``PREDICTED_BOXES``)."""
        self._shadows[fake] = _Shadow(value, frozenset({source}))

    def mask_count(self, out: torch.Tensor, most: int) -> None:
        """``out`` counts the set elements of a mask whose values are unknown: taken at ``most``,
        all it can be (the bounds' view of a mask: at most all true)."""
        with unset_fake_temporarily():
            value = torch.tensor(most, dtype=out.dtype)
        self._shadows[out] = _Shadow(value, frozenset({MASK_COUNT}))

    def get(self, t: Any) -> _Shadow | None:
        """The shadow of ``t``; a real tensor (a constant the model made, such as the ``1`` of
        ``mask[idx] = 1``, before it is lifted to a fake one) is its own."""
        if not isinstance(t, torch.Tensor):
            return None
        found: _Shadow | None = self._shadows.get(t)
        if found is None and not holds_fakes(t) and t.device.type != "meta" \
                and (self.real_limit is None or t.numel() <= self.real_limit):
            found = _Shadow(t, frozenset())
        return found

    def weak_tables(self) -> tuple[list[WeakIdKeyDictionary], list[WeakIdKeyDictionary]]:
        """The tables that hold tensors by weak reference (graphmem.trace.core.recorder's swap):
        of their values (a swap swaps them), and of the tensors themselves (kept)."""
        return [self._shadows], [self._unfollowed]

    def forget(self, t: torch.Tensor) -> None:
        """``t`` holds values no shadow follows, now and from now on (a parameter: initialised at
        random, then updated by its optimizer)."""
        self._shadows.pop(t, None)
        self._unfollowed[t] = True

    def propagate(self, func: Any, args: Any, kwargs: Any, out: Any, decisions: bool = True) -> None:
        """Run ``func`` on the shadows of its arguments, when they all have one.  ``decisions``
        (the model's own code): random draws, NaN checks and choices from unknown values are
        answered as the module docstring says; else (a program's data code) they are plain ops,
        known where their arguments are."""
        if not decisions:
            self._follow_values(func, args, kwargs, out)
            return
        if func == torch.ops.aten.uniform_.default and hint_of(args[0].numel()) <= SHADOW_LIMIT:
            self._draw(out, args[1] if len(args) > 1 else kwargs.get("from", 0.0),
                       args[2] if len(args) > 2 else kwargs.get("to", 1.0))
            return  # it overwrites every value of its tensor: what the tensor held before does not matter
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        unknown = any(self.get(t) is None for t in tensors)
        if unknown and func.overloadpacket in ops.FINITE_CHECKS and isinstance(out, torch.Tensor):
            self.finite_check(out, ops.FINITE_CHECKS[func.overloadpacket])
            return
        if unknown and func in ops.CHOICES and tensors[0].is_floating_point():  # its one tensor is unknown
            self.choose(func, args, kwargs, out)
            return
        if unknown:
            self._forget_written(func, args, kwargs)  # an op on unknown values overwrote them
            return
        # uninitialised memory is unknown in a real run too (FSDP2's all-gather buffers, then written by collectives)
        if not outs or any(hint_of(o.numel()) > SHADOW_LIMIT for o in outs) or func.overloadpacket in UNINITIALISED:
            return
        if func.overloadpacket in ops.UNIFORM_DRAWS and isinstance(out, torch.Tensor) and out.is_floating_point():
            self._draw(out, 0.0, 1.0)
            return
        try:
            real = self.run(func, args, kwargs)
        except OP_ERRORS:  # values the real op refuses (none seen): no shadow
            return
        self.attach(args, kwargs, out, real)

    def _follow_values(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """The op on real values where every argument is known (a random draw draws for real;
        an op that overwrites every value of its tensor needs none of them)."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        overwritten = func.overloadpacket in ops.OVERWRITES and tensors and tensors[0] is args[0] \
            and self.get(args[0]) is None and args[0] not in self._unfollowed
        if any(self.get(t) is None for t in tensors[1 if overwritten else 0:]):
            if func.overloadpacket in ops.FINITE_CHECKS and isinstance(out, torch.Tensor):
                # ``if torch.isnan(loss).any(): skip the step``: a run that trains has no NaN
                self.finite_check(out, ops.FINITE_CHECKS[func.overloadpacket])
                return
            self._forget_written(func, args, kwargs)
            return
        if not outs or any(hint_of(o.numel()) > SHADOW_LIMIT for o in outs) or func.overloadpacket in UNINITIALISED:
            return
        if overwritten:  # on fresh memory of the same shape: its old values are not read
            with unset_fake_temporarily():
                blank = torch.empty([hint_of(d) for d in args[0].shape], dtype=args[0].dtype)
            self._shadows[args[0]] = _Shadow(blank, frozenset())
        try:
            real = self.run(func, args, kwargs)
        except OP_ERRORS:  # values the real op refuses (none seen): no shadow
            return
        self.attach(args, kwargs, out, real)

    def copied(self, new: torch.Tensor, old: torch.Tensor) -> None:
        """``new`` is a copy of ``old`` made outside the ops (``copy.deepcopy``): its own copy of
        ``old``'s known values, if any (an in-place op on either then changes only its own)."""
        found: _Shadow | None = self._shadows.get(old)
        if found is None:
            return
        with outside_modes():
            value = found.value.clone()
        self._shadows[new] = _Shadow(value, found.sources)

    def _draw(self, out: torch.Tensor, low: float, high: float) -> None:
        """A uniform draw in [low, high): its largest value, just below ``high``, everywhere."""
        with unset_fake_temporarily():
            top = torch.nextafter(torch.tensor(high, dtype=out.dtype), torch.tensor(low, dtype=out.dtype))
            value = top.expand(tuple(hint_of(d) for d in out.shape)).contiguous()
        self._shadows[out] = _Shadow(value, frozenset({RANDOM_DRAW}))

    def choose(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """The indices ``func`` (top-k, argmax or max along a dimension) picks from values no
        shadow knows, as ``spread`` gives them."""
        x, indices = args[0], out[1] if isinstance(out, tuple) else out
        if func is torch.ops.aten.topk.default:
            k, dim = args[1], args[2] if len(args) > 2 else kwargs.get("dim", -1)
        else:
            k, dim = 1, args[1] if len(args) > 1 else kwargs.get("dim")
        if hint_of(indices.numel()) > SHADOW_LIMIT or x.dim() == 0 or dim is None:
            return
        with unset_fake_temporarily():
            value = spread([hint_of(d) for d in x.shape], dim, hint_of(k), self.routing)
            value = value.reshape([hint_of(s) for s in indices.shape]).to(indices.dtype)
        self._shadows[indices] = _Shadow(value, frozenset({_routed(self.routing)}))

    def finite_check(self, out: torch.Tensor, value: bool) -> None:
        """``out`` is a NaN / inf check of unknown values: ``value`` everywhere (finite values)."""
        with unset_fake_temporarily():  # one element, expanded: no memory whatever the size
            # (torch.ones/zeros, not torch.tensor: its lift_fresh would pass through the recorder)
            one = torch.ones((), dtype=torch.bool) if value else torch.zeros((), dtype=torch.bool)
            known = one.expand(tuple(hint_of(d) for d in out.shape))
        self._shadows[out] = _Shadow(known, frozenset({FINITE}))

    def _forget_written(self, func: Any, args: Any, kwargs: Any) -> None:
        """Drop the shadows of the arguments ``func`` writes (in place or ``out=``): a buffer
        made from constants (FSDP2's all-gather outputs) then holds values no shadow knows."""
        schema = getattr(func, "_schema", None)
        if schema is None or not schema.is_mutable:
            return
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    self._shadows.pop(t, None)

    def attach(self, args: Any, kwargs: Any, out: Any, real: Any) -> None:
        """Record ``real`` as the values of the fake outputs ``out`` of an op on ``args``."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        sources = frozenset().union(*(self._of(t).sources for t in tensors)) if tensors else frozenset()
        fakes = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for fake, value in zip(fakes, [t for t in tree_flatten(real)[0] if isinstance(t, torch.Tensor)], strict=False):
            if fake not in self._unfollowed:
                self._shadows[fake] = _Shadow(value, sources)

    def run(self, func: Any, args: Any, kwargs: Any) -> Any:
        """``func`` on real shadow values (every tensor argument must have a shadow)."""
        swap = lambda a: self._of(a).value if isinstance(a, torch.Tensor) else hint_of(a) \
            if isinstance(a, torch.SymInt) else a
        real_args, real_kwargs = tree_map(swap, (tuple(args), dict(kwargs)))
        with unset_fake_temporarily():
            return func(*real_args, **real_kwargs)

    def answerable(self, args: Any, kwargs: Any) -> bool:
        """Whether every tensor argument has a shadow (so the op can be run for real)."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        return all(self.get(t) is not None for t in tensors)

    def sources(self, args: Any, kwargs: Any) -> frozenset[str]:
        """What the values of the tensor arguments rest on (each must have a shadow)."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        return frozenset().union(*(self._of(t).sources for t in tensors)) if tensors else frozenset()

    def known_values(self, args: Any, kwargs: Any) -> tuple[dict[int, torch.Tensor], frozenset[str]]:
        """The real values of the tensor arguments that have a shadow, by id, and the
        assumptions they rest on."""
        known: dict[int, torch.Tensor] = {}
        sources: frozenset[str] = frozenset()
        for t in tree_flatten((args, kwargs))[0]:
            shadow = self.get(t)
            if shadow is not None:
                known[id(t)] = shadow.value
                sources |= shadow.sources
        return known, sources

    def _of(self, t: torch.Tensor) -> _Shadow:
        found = self.get(t)
        assert found is not None, "Shadows: a tensor without a shadow"
        return found


def spread(sizes: list[int], dim: int, k: int, routing: str) -> torch.Tensor:
    """The ``k`` indices picked along ``dim`` of a tensor of ``sizes``, for ``--assume routing``
    (shape: ``sizes`` with ``k`` at ``dim``).  Over the ``n`` candidates, row ``r`` (the other
    dimensions, flattened) picks, for ``j < k``: ``uneven``: ``(r + j) % n`` for the first ``n``
    rows, so every candidate is picked, then ``j`` (the first ``k`` get nearly all);
    ``balanced``: ``(r * k + j) % n`` (each gets its share)."""
    d = dim % len(sizes)
    n, other = sizes[d], sizes[:d] + sizes[d + 1:]
    rows = torch.arange(math.prod(other)).unsqueeze(1)
    picks = torch.arange(k).unsqueeze(0)
    chosen = (rows * k + picks) % n if routing == "balanced" else torch.where(rows < n, (rows + picks) % n, picks)
    return chosen.reshape([*other, k]).movedim(-1, d).contiguous()


def _routed(routing: str) -> str:
    """The source of the shadows ``choose`` makes under ``routing``."""
    return f"routing={routing}"


_ROUTING_NOTES = {
    "uneven": "the model chooses from values graphmem does not have (torch.topk or argmax, as an MoE router picks its "
              "experts): taken as uneven as can be, every expert picked once and the first ones taking all the rest; "
              f"a real run routes by its values, so its peak differs a little ({spelling('assume')} routing=balanced "
              "spreads them "
              "evenly)",
    "balanced": "the model chooses from values graphmem does not have (torch.topk or argmax, as an MoE router picks "
                f"experts): taken spread evenly, as declared with {spelling('assume')} routing=balanced",
}


def describe(used: set[str], declared: Mapping[str, str]) -> list[str]:
    """Assumption notes for the report, one per assumed input an answer depended on."""
    words = {"ones": "all ones (no padding)", "zeros": "all zeros", "arange": "0, 1, 2, ... (no packing)",
             **{kind: f"random integers below {kind.removeprefix(BELOW)}" for kind in
                {s.partition("=")[2] for s in used} if kind.startswith(BELOW)}}
    notes = []
    if RANDOM_DRAW in used:
        notes.append("upper bound: the model reads a random draw (torch.rand, e.g. LayerDrop's `if torch.rand([]) < "
                     "layerdrop`, or uniform_, e.g. a detection model's random choice of image size); it was taken "
                     "as its largest value, so every layer it could skip runs and a random choice takes its last "
                     "option")
    if FINITE in used:
        notes.append("the model checks its values for NaN or inf (torch.isnan, isinf, isfinite): answered as a run "
                     "without any answers it")
    if BUILT in used:
        notes.append("the model reads values of its buffers (a padding size, a stride): answered with the values "
                     "its constructor computed, as a run of the model as built")
    if PREDICTED_BOXES in used:
        notes.append("upper bound: the model reads the sizes of the boxes it predicts (to paste each mask into the "
                     "image at its box's size, or to read keypoints from heatmaps resized to it); each box was "
                     "taken as covering the whole image, the largest it can be")
    if MASK_COUNT in used:
        notes.append("upper bound: the model reads how many elements of a mask are set (a count of foreground "
                     "anchors, say) where the mask depends on values; taken as the most they can be")
    notes += [_ROUTING_NOTES[routing] for routing in ROUTINGS if _routed(routing) in used]
    if SAMPLE in used:
        notes.append(f"the values the model reads from its inputs are the sample's ({spelling('sample')})")
    named = {RANDOM_DRAW, FINITE, BUILT, TARGETS, PREDICTED_BOXES, MASK_COUNT, SAMPLE, *map(_routed, ROUTINGS)}
    for item in sorted(used - named):
        name, _, kind = item.partition("=")
        origin = f"as declared with {spelling('assume')}" if name in declared else "by default"
        notes.append(f"input {name} assumed {words.get(kind, '= ' + kind)} {origin}, to answer a "
                     "value the model reads")
    return notes
