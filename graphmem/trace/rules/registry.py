"""Per-op knowledge: the one registry of rules, keyed by aten op overload.

A rule answers what the recorded graph cannot show.  Four kinds, all pure functions of the
op's tensor metadata and non-tensor arguments (they never see a tensor):

  - ``scratch``: bytes an op's kernel allocates for itself while it runs (workspace) and
    frees before it returns -> int bytes;
  - ``output_dtypes``: where the device's real kernel returns an output in another dtype
    than the fake kernel does -> {output index: dtype};
  - ``output_shapes``: where the device's real kernel returns an output of another size
    than the fake kernel does (a library workspace the meta kernel leaves empty)
    -> {output index: shape};
  - ``fake_kernel``: where torch's meta kernel refuses inputs the real kernel accepts (so
    no output exists to fix), or lays the output out otherwise
    -> the output's ``ArgMeta`` (shape, dtype, strides) as the
    real kernel makes it, raising the real kernel's error for inputs it refuses.  Fake
    tensors live on the CPU, so the fake tensor mode (graphmem._torch_api) runs the
    ``cpu`` ones, in place of the meta kernel, for every target;
  - ``output_bounds``: where an op's output size depends on tensor values (``nonzero``,
    boolean-mask indexing, ``unique``), the largest outputs it can return -> a ``Bound``:
    the most elements the value-dependent count can reach and, per output, its shape
    (``None`` where the count goes) and dtype.  Registered for ``device="any"``: the limits
    are the op's own, whatever the device.
  - ``flops``: the FLOPs of an op torch.utils.flop_counter has no formula for (a library's
    own op, bitsandbytes' 4-bit matmul) -> int.
  - ``value_kernel``: where an op's output sizes depend on the values of small tensor
    arguments that graphmem knows (derived from the assumed inputs: lengths computed from an
    attention mask, graphmem.trace.values.shadows), the outputs -> an ``ArgMeta`` or a tuple of them,
    or None when a value it needs is unknown.  Each such argument is given as the real tensor
    holding its values, the others as ``ArgMeta``.

    @register(aten.mm.default, device="cuda")
    def mm_workspace(args: tuple[ArgMeta, ...], kwargs: dict) -> int: ...

    @register(aten.native_batch_norm.default, device="cpu", kind="output_dtypes")
    def mixed_type_stats(args, kwargs) -> dict[int, torch.dtype]: ...

    @register(aten.mkldnn_rnn_layer.default, device="cpu", kind="output_shapes")
    def onednn_lstm_workspace(args, kwargs) -> dict[int, tuple[int, ...]]: ...

Nothing but ``register`` writes to the table.  Users extend with a mapping passed to
``graphmem.analyze(rules=...)``, never by mutating this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum, unique
from typing import Any

import torch

from graphmem._torch_api import OpOverload, tree_map

__all__ = ["ArgMeta", "Bound", "Rule", "RuleKind", "RuleTable", "metas", "output_bounds", "output_shapes", "register",
           "rules_for", "scratch_bytes"]


@dataclass(frozen=True, slots=True)
class ArgMeta:
    """What a rule may know about a tensor argument: shape, dtype and strides."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    storage_numel: int | None = None  # a fake_kernel's output whose storage is larger than its view needs


@dataclass(frozen=True, slots=True)
class Bound:
    """An ``output_bounds`` rule's answer: ``count`` is the most the value-dependent size can
    be; ``outputs`` the op's outputs in order, each (shape with None for the count, dtype)."""

    count: int
    outputs: tuple[tuple[tuple[int | None, ...], torch.dtype], ...]

    def shapes(self, count: int) -> list[tuple[int, ...]]:
        """The outputs' shapes when the value-dependent size is ``count``."""
        return [tuple(count if n is None else n for n in shape) for shape, _ in self.outputs]


def metas(args: Any, kwargs: Any, known: Mapping[int, torch.Tensor] | None = None) -> tuple[Any, Any]:
    """An op's arguments as a rule sees them: tensors as ``ArgMeta``, except those in
    ``known`` (by id), which are given as the real tensors holding their values."""
    def one(value: Any) -> Any:
        if known and isinstance(value, torch.Tensor) and id(value) in known:
            return known[id(value)]
        if isinstance(value, torch.Tensor):
            return ArgMeta(tuple(value.shape), value.dtype, tuple(value.stride()))
        return value
    return tree_map(one, tuple(args)), tree_map(one, dict(kwargs))


# scratch rules return int bytes; output_dtypes rules return {output index: dtype};
# output_shapes rules return {output index: shape}; fake_kernel rules return an ArgMeta
Rule = Callable[[tuple[Any, ...], Mapping[str, Any]], Any]



@unique
class RuleKind(StrEnum):
    """What a rule answers (the module docstring gives each kind's question and answer)."""

    SCRATCH = "scratch"
    OUTPUT_DTYPES = "output_dtypes"
    OUTPUT_SHAPES = "output_shapes"
    FAKE_KERNEL = "fake_kernel"
    OUTPUT_BOUNDS = "output_bounds"
    FLOPS = "flops"
    VALUE_KERNEL = "value_kernel"


_RULES: dict[tuple[str, RuleKind, OpOverload | str], Rule] = {}


@dataclass(frozen=True, slots=True)
class RuleTable:
    """The rules in force for one target device, by kind."""

    scratch: Mapping[OpOverload, Rule]
    output_dtypes: Mapping[OpOverload, Rule]
    output_shapes: Mapping[OpOverload, Rule]
    fake_kernels: Mapping[OpOverload, Rule]
    output_bounds: Mapping[OpOverload, Rule]
    flops: Mapping[OpOverload, Rule] = field(default_factory=dict)
    value_kernels: Mapping[OpOverload, Rule] = field(default_factory=dict)


def register(op: OpOverload | str | Sequence[OpOverload | str], *, device: str,
             kind: RuleKind | str = RuleKind.SCRATCH) -> Callable[[Rule], Rule]:
    """Decorator registering ``fn`` as the ``kind`` rule of ``op`` (or of each op of a list) on
    ``device``.  An op may be a library's op by name (``"torchvision::nms.default"``): its rule
    applies once that library has registered the op (the user's model imported it).

    Raises:
        TypeError: an op is not an OpOverload (e.g. an OpOverloadPacket) nor "namespace::name.overload".
        ValueError: an unknown kind, or a rule for (device, kind, op) exists already; names both functions.
    """
    ops: list[OpOverload | str] = list(op) if isinstance(op, (list, tuple)) else [op]  # type: ignore[list-item]
    for one in ops:
        if isinstance(one, str):
            if not re.fullmatch(r"\w+::\w+\.\w+", one):
                raise TypeError(f"register: expected an op name such as 'torchvision::nms.default', got {one!r}")
        elif not isinstance(one, OpOverload):
            raise TypeError(f"register: expected an OpOverload such as aten.mm.default, got {one!r}")
    if kind not in set(RuleKind):
        raise ValueError(f"register: unknown kind {kind!r}; expected one of {tuple(k.value for k in RuleKind)}")
    rule_kind = RuleKind(kind)

    def decorate(fn: Rule) -> Rule:
        for one in ops:
            key = (device, rule_kind, one)
            if key in _RULES:
                old = _RULES[key]
                raise ValueError(f"register: duplicate rule for {one} on {device}: "
                                 f"{old.__module__}.{old.__qualname__} and {fn.__module__}.{fn.__qualname__}")
            _RULES[key] = fn
        return fn

    return decorate


def rules_for(device: str, extra: Mapping[OpOverload, Rule] | None = None) -> RuleTable:
    """The rules for ``device``; ``extra`` adds or overrides scratch rules."""
    def of(wanted: RuleKind) -> dict[OpOverload, Rule]:
        found = ((_resolved(op), fn) for (dev, kind, op), fn in _RULES.items() if dev in (device, "any")
                 and kind == wanted)
        return {op: fn for op, fn in found if op is not None}

    scratch = of(RuleKind.SCRATCH)
    scratch.update(extra or {})
    return RuleTable(scratch=scratch, output_dtypes=of(RuleKind.OUTPUT_DTYPES),
                     output_shapes=of(RuleKind.OUTPUT_SHAPES), fake_kernels=of(RuleKind.FAKE_KERNEL),
                     output_bounds=of(RuleKind.OUTPUT_BOUNDS), flops=of(RuleKind.FLOPS),
                     value_kernels=of(RuleKind.VALUE_KERNEL))


def _resolved(op: OpOverload | str) -> OpOverload | None:
    """``op`` itself, or the op a name stands for once its library registered it (else None)."""
    if not isinstance(op, str):
        return op
    namespace, _, rest = op.partition("::")
    name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):  # the library is not loaded
        return None
    found = getattr(packet, overload, None)
    return found if isinstance(found, OpOverload) else None


def scratch_bytes(rule: Rule, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | torch.SymInt:
    """Call ``rule`` on metadata (tensors already replaced by ``ArgMeta``) and check its answer."""
    result = rule(args, kwargs)
    # a symbolic size (graphmem.trace.symbolic) gives a SymInt, which the recorder keeps as a formula
    if not isinstance(result, (int, torch.SymInt)) or result < 0:
        raise AssertionError(f"scratch_bytes: rule {rule.__qualname__} returned {result!r}, "
                             "expected a non-negative int")
    return result


def output_shapes(rule: Rule, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[int, tuple[int, ...]]:
    """Call an ``output_shapes`` rule on metadata and check its answer: {output index: shape}."""
    result = rule(args, kwargs)
    if not isinstance(result, dict) or not all(
            isinstance(i, int) and i >= 0 and isinstance(shape, tuple)
            and all(isinstance(n, int) and n >= 0 for n in shape) for i, shape in result.items()):
        raise AssertionError(f"output_shapes: rule {rule.__qualname__} returned {result!r}, "
                             "expected {output index: tuple of non-negative ints}")
    return result


def output_bounds(rule: Rule, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Bound:
    """Call an ``output_bounds`` rule on metadata and check its answer."""
    result = rule(args, kwargs)
    if not isinstance(result, Bound) or result.count < 0 or not result.outputs:
        raise AssertionError(f"output_bounds: rule {rule.__qualname__} returned {result!r}, expected a Bound "
                             "with a count >= 0 and at least one output")
    return result
