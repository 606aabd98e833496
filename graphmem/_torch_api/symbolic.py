"""Size symbols: torch's ShapeEnv, a symbol's value while recording, the guards a recording took."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch._refs

from graphmem._torch_api.fakes import FakeTensorMode

__all__ = ["MAX_SYMBOLIC_SIZE", "SYMBOLIC_REFERENCES", "ShapeEnv", "expr_of", "hint_of", "shape_guards", "size_symbol"]

# torch.fx.experimental.symbolic_shapes (and with it sympy, 0.6 s) is imported where a size may
# be a symbol, not at import: a recording with concrete sizes never needs it.
if TYPE_CHECKING:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
else:
    def ShapeEnv(*args: Any, **kwargs: Any) -> Any:
        """torch's ``ShapeEnv(...)``, its module imported on the first call."""
        from torch.fx.experimental.symbolic_shapes import ShapeEnv as shape_env

        return shape_env(*args, **kwargs)


# ops whose C++ meta kernel reads sizes as numbers (a guard that pins a size symbol to its
# value) where torch's Python reference keeps them symbols; used where sizes are symbols
SYMBOLIC_REFERENCES: dict[Any, Any] = {torch.ops.aten.constant_pad_nd.default: torch._refs.constant_pad_nd}


MAX_SYMBOLIC_SIZE = 2**40  # the largest value a size symbol is assumed to take


def size_symbol(mode: FakeTensorMode, name: str, hint: int) -> torch.SymInt:
    """A new size symbol of ``mode``'s ShapeEnv whose value while recording is ``hint`` (>= 2:
    PyTorch specialises sizes 0 and 1)."""
    env = mode.shape_env
    assert env is not None and hint >= 2, "size_symbol: a symbolic mode and a hint >= 2"
    from torch._dynamo.source import (
        ConstantSource,  # here, not at import: torch._dynamo takes ~1 s to import
    )
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    source = ConstantSource(f"graphmem_{name}")
    expr = env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC)
    # a size fits an int64 index: an open slice ``x[:, 0:]`` (end = INT64_MAX, clamped to
    # the size) then simplifies to the whole dimension, a view, as it does with numbers
    env.constrain_symbol_range(expr, compiler_min=2, compiler_max=MAX_SYMBOLIC_SIZE)
    value = env.create_symintnode(expr, hint=hint, source=source)
    assert isinstance(value, torch.SymInt), f"size_symbol: {name}={hint} was specialised"
    return value


def hint_of(value: Any) -> int:
    """The value a size has while recording, without adding a guard (an int stays itself)."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    from torch.fx.experimental.symbolic_shapes import (
        guarding_hint_or_throw,  # loaded: a SymInt exists
    )

    return int(guarding_hint_or_throw(value))


def expr_of(value: Any) -> Any:
    """A size as a sympy expression of the size symbols (an int stays itself)."""
    return value.node.expr if isinstance(value, torch.SymInt) else int(value)


def shape_guards(mode: FakeTensorMode) -> tuple[Any, ...]:
    """The conditions on size symbols that the recording took as given (sympy booleans)."""
    env = mode.shape_env
    return tuple(guard.expr for guard in env.guards) if env is not None else ()
