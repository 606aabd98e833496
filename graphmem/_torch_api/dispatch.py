"""The dispatcher: op schemas, kernels registered per dispatch key, dispatch modes, FLOP
formulas, torch's checks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._ops import HigherOrderOperator, OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from graphmem._torch_api.fakes import OP_ERRORS

__all__ = ["HigherOrderOperator", "OpOverload", "TENSOR_CHECK", "TorchDispatchMode", "check_with", "count_flops",
           "destroy_library", "dispatch_key_guard", "dispatch_modes_pushed", "is_cached_tensor", "op_schema",
           "ops_with_kernel_for", "outside_modes", "sdp_priority_order", "tensor_check", "tree_flatten", "tree_map"]


def count_flops(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """FLOPs of one aten op from torch.utils.flop_counter's formulas (0 for ops it has none
    for): an int, or a SymInt where the sizes are symbols."""
    formula = flop_registry.get(getattr(func, "overloadpacket", func))  # a higher-order op: by itself
    if formula is None:
        return 0
    try:
        value = formula(*args, **kwargs, out_val=out)
    except OP_ERRORS:  # a formula that does not accept this overload's arguments
        return 0
    return value if isinstance(value, torch.SymInt) else int(value)


def ops_with_kernel_for(dispatch_key: str) -> frozenset[str]:
    """The ops ("aten::softmax.int") the installed torch registers a kernel for ``dispatch_key``."""
    return frozenset(name for name in torch._C._dispatch_get_all_op_names()
                     if torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key))


def is_cached_tensor(t: torch.Tensor) -> bool:
    """at::caching::is_cached_tensor: a tensor CUDA graph trees keep (never cast-cached)."""
    return bool(torch._C._is_cached_tensor(t))  # type: ignore[attr-defined]


def dispatch_key_guard(key_name: str) -> Any:
    """A factory of guards excluding the dispatch key ``key_name`` ("AutocastCPU") while open."""
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key_name))
    return lambda: torch._C._ExcludeDispatchKeyGuard(excluded)


def sdp_priority_order() -> list[int]:
    """The order (backend numbers) in which scaled_dot_product_attention tries its kernels."""
    return [int(number) for number in torch._C._get_sdp_priority_order()]


check_with = torch._check_with  # torch._check with the error type to raise

TENSOR_CHECK = "_check_tensor_all_with"  # torch's check that every element of a bool tensor is true


def tensor_check() -> Callable[..., None]:
    """torch._check_tensor_all_with as it is now (a recording may have replaced it)."""
    check: Callable[..., None] = getattr(torch, TENSOR_CHECK)
    return check


@contextlib.contextmanager
def dispatch_modes_pushed(seen: Callable[[TorchDispatchMode], None]) -> Iterator[None]:
    """Inside, ``seen(mode)`` is called on every TorchDispatchMode as it is entered, before it
    goes on torch's dispatch mode stack (``torch.utils._python_dispatch._push_mode``, which
    ``TorchDispatchMode.__enter__`` calls)."""
    from torch.utils import _python_dispatch

    push = _python_dispatch._push_mode

    def pushed(mode: TorchDispatchMode) -> None:
        seen(mode)
        push(mode)

    _python_dispatch._push_mode = pushed
    try:
        yield
    finally:
        _python_dispatch._push_mode = push


def outside_modes() -> contextlib.AbstractContextManager[Any]:
    """Inside, no dispatch mode is active (the recorder's and the fake mode's included): ops on
    real tensors run for real, unrecorded; a fake tensor's own ops still run on fakes."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def op_schema(op: Any) -> Any:
    """An aten op overload's schema: its ``arguments``, ``returns``, ``is_mutable``."""
    return op._schema


def destroy_library(library: torch.library.Library) -> None:
    """Deregister every kernel ``library`` registered (the dispatcher restores those beneath)."""
    library._destroy()
