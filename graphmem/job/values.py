"""The values of the small tensors a model computes while it is built (stage 1, beside load).

A model built on the meta device keeps no values, but some constructors compute constants
their forward later reads: EnCodec's convolutions keep their stride, kernel size and padding
as one-element buffers (``nn.Buffer(torch.tensor(k - s))``) and its forward pads by them.
While a model is built on meta (``kept_values``), every tensor of at most ``VALUE_LIMIT``
elements computed only from constants (``torch.tensor``, ``torch.arange``, arithmetic on
them, ``copy_`` of a known value) also gets its real value, computed on CPU.  Random draws
(weight initialisation) and uninitialised memory have none, nor anything computed from them.

``built_value(t)`` gives a buffer's value to stage 2 (trace), which answers the forward's
reads of it with that value, as a real run of the same model does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from graphmem._torch_api import OP_ERRORS, TorchDispatchMode, tree_flatten, tree_map

__all__ = ["UNINITIALISED", "VALUE_LIMIT", "built_value", "keep_value", "kept_values"]

VALUE_LIMIT = 1 << 16  # elements: a value kept costs at most 512 KiB of real memory
_BUDGET = 64 << 20  # bytes kept in all, for one build
_VALUES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # meta tensor -> its real value (CPU)
# factories that copy Python data; they make a meta tensor without any op the dispatcher sees
_FROM_DATA = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
# factories of uninitialised memory: no value, here or in a real run (graphmem.trace.values.shadows too)
UNINITIALISED = frozenset({torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like,
                           torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided})
# random draws (weight initialisation, dropout): a real build draws other values
_aten = torch.ops.aten
_RANDOM = frozenset({
    _aten.rand, _aten.rand_like, _aten.randn, _aten.randn_like, _aten.randint, _aten.randint_like, _aten.randperm,
    _aten.normal, _aten.normal_, _aten.uniform, _aten.uniform_, _aten.bernoulli, _aten.bernoulli_, _aten.cauchy,
    _aten.cauchy_, _aten.exponential, _aten.exponential_, _aten.geometric, _aten.geometric_, _aten.log_normal,
    _aten.log_normal_, _aten.random_, _aten.multinomial, _aten.poisson, _aten.native_dropout, _aten.dropout,
})


def built_value(t: torch.Tensor) -> torch.Tensor | None:
    """The real value of ``t`` (a meta tensor made while a model was built under
    ``kept_values``, or a small real tensor of a user's model), a copy; None when unknown."""
    found = _VALUES.get(t) if t.is_meta else t.detach() if _small_on_cpu(t) else None
    return None if found is None else found.clone()


def keep_value(meta: torch.Tensor, real: torch.Tensor) -> None:
    """``meta`` stands for the real tensor ``real`` (a model built on CPU, moved to meta)."""
    if _small_on_cpu(real):
        _VALUES[meta] = real.detach().clone()


def _small_on_cpu(t: torch.Tensor) -> bool:
    return t.numel() <= VALUE_LIMIT and t.device.type == "cpu"


@contextlib.contextmanager
def kept_values() -> Iterator[None]:
    """Keep the real values of the small constant tensors made inside (on the meta device)."""
    keeper = _Keeper()
    with _FromData(keeper), keeper:
        yield


class _Keeper(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.kept = 0  # bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.follow(func, args, kwargs, out)
        return out

    def follow(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Compute ``func``'s outputs for real when all its tensor arguments have a value."""
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_meta]
        if not outs:
            return
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        known = all(_value(t) is not None for t in tensors)
        small = all(o.numel() <= VALUE_LIMIT for o in outs) and self.kept < _BUDGET
        if not known or not small or func.overloadpacket in UNINITIALISED or func.overloadpacket in _RANDOM:
            for t in outs:  # a tensor written in place with unknown values now holds them
                _VALUES.pop(t, None)
            return
        real_args, real_kwargs = tree_map(_real, (tuple(args), dict(kwargs)))
        try:
            real = func(*real_args, **real_kwargs)
        except OP_ERRORS:  # a value we cannot compute stays unknown
            for t in outs:
                _VALUES.pop(t, None)
            return
        reals = [t for t in tree_flatten(real)[0] if isinstance(t, torch.Tensor)]
        for fake, value in zip(outs, reals, strict=False):
            self.keep(fake, value)

    def keep(self, meta: torch.Tensor, value: torch.Tensor) -> None:
        """``meta`` holds ``value``; counted against the budget once."""
        if meta not in _VALUES:
            self.kept += value.numel() * value.element_size()
        _VALUES[meta] = value


class _FromData(TorchFunctionMode):
    """``torch.tensor(data)`` on meta: its value from the same call on CPU."""

    def __init__(self, keeper: _Keeper) -> None:
        super().__init__()
        self.keeper = keeper

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FROM_DATA and isinstance(out, torch.Tensor) and out.is_meta and out.numel() <= VALUE_LIMIT \
                and self.keeper.kept < _BUDGET:
            with contextlib.suppress(*OP_ERRORS):  # not on the CPU (data holding meta tensors): it stays unknown
                self.keeper.keep(out, func(*args, **{**kwargs, "device": "cpu"}))
        return out


def _value(t: torch.Tensor) -> torch.Tensor | None:
    return _VALUES.get(t) if t.is_meta else t if t.device.type == "cpu" else None


def _real(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return _value(a)
    if isinstance(a, torch.device) and a.type == "meta":
        return torch.device("cpu")
    return a
