"""An op's outputs as the real kernel makes them, where the fake kernel differs; and the dtypes it refuses.

Input: an op, its (fake) arguments and the fake kernel's outputs.  Output: outputs with the
rules' dtypes and sizes (graphmem.trace.rules: ``output_dtypes``, ``output_shapes``), each
non-aliasing output on its own storage; and, for dtype mixes, the real CPU kernel's refusal.
"""

from __future__ import annotations

from typing import Any

import torch

from graphmem._torch_api import op_schema, tree_flatten, tree_map, unset_fake_temporarily
from graphmem.errors import UserInputError
from graphmem.job.option import spelling
from graphmem.trace.rules.registry import RuleTable, metas, output_shapes

__all__ = ["DtypeChecks", "fixed_outputs", "fresh_outputs"]


def fixed_outputs(rules: RuleTable, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """``out`` with the op's output_dtypes and output_shapes rules applied: outputs re-created
    in the real kernel's dtype, then with the real kernel's size."""
    dtype_rule, shape_rule = rules.output_dtypes.get(func), rules.output_shapes.get(func)
    if (dtype_rule is None and shape_rule is None) or not isinstance(out, tuple):
        return out
    meta_args, meta_kwargs = metas(args, kwargs)
    if dtype_rule is not None:
        fixes = dtype_rule(meta_args, meta_kwargs)
        out = tuple(torch.empty_like(t, dtype=fixes[i]) if i in fixes else t for i, t in enumerate(out))
    if shape_rule is not None:
        shapes = output_shapes(shape_rule, meta_args, meta_kwargs)
        out = tuple(t.new_empty(shapes[i]) if i in shapes else t for i, t in enumerate(out))
    return out


def fresh_outputs(func: Any, out: Any) -> Any:
    """Give each non-aliasing output of ``func`` its own storage.

    A return without an alias annotation in the op's schema is a fresh tensor on every real
    backend, but a few meta kernels return one tensor twice (mkldnn_rnn_layer_backward gives
    the same bias gradient for bias_ih and bias_hh).  That shared storage would make
    AccumulateGrad copy a gradient the real run steals, so the duplicate is replaced.
    """
    if not isinstance(out, tuple) or len(out) < 2:
        return out
    returns = op_schema(func).returns
    seen: set[int] = set()
    fixed = list(out)
    for i, item in enumerate(out):
        if not isinstance(item, torch.Tensor) or i >= len(returns) or returns[i].alias_info is not None:
            continue
        if id(item) in seen:
            fixed[i] = torch.empty_like(item)
        seen.add(id(item))
    return tuple(fixed)


_DTYPE_WORDS = ("dtype", "scalar type")


def _real_dtype_error(func: Any, args: Any, kwargs: Any) -> str:
    """The real CPU kernel's dtype complaint about ``func`` on one-element tensors of the same
    dtypes and ranks as ``args`` ("" when it has none: it runs, or fails for another reason)."""
    def tiny(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.zeros([1] * value.dim(), dtype=value.dtype)
        return value
    with unset_fake_temporarily():
        try:
            real_args, real_kwargs = tree_map(tiny, (tuple(args), dict(kwargs)))
            func(*real_args, **real_kwargs)
        except (RuntimeError, TypeError) as exc:
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return text if any(word in text for word in _DTYPE_WORDS) else ""
    return ""


class DtypeChecks:
    """Fake and meta kernels accept some dtype mixes the real CPU kernel refuses (an int64 or
    float16 input into a float32 Linear): when an op's tensors disagree in dtype, it is run once
    on one-element real tensors of the same dtypes; if the real kernel refuses the dtypes, so
    does graphmem, with PyTorch's own message.  Cached per op and dtypes."""

    def __init__(self) -> None:
        self._checked: dict[Any, str] = {}

    def refuse(self, func: Any, args: Any, kwargs: Any, op: str, module: str) -> None:
        """Raise the real kernel's refusal of ``func``'s dtypes, naming ``op`` and ``module``.

        Raises:
            UserInputError: the real CPU kernel refuses these dtypes.
        """
        key = (func, tuple((t.dtype, t.dim()) if isinstance(t, torch.Tensor) else None
                           for t in tree_flatten((args, kwargs))[0]))
        if key not in self._checked:
            self._checked[key] = _real_dtype_error(func, args, kwargs)
        message = self._checked[key]
        if message:
            where = f"module {module}" if module else "the model"
            raise UserInputError(f"{where} runs {op.split('.')[1] if '.' in op else op} on inputs whose dtypes "
                                 f"PyTorch refuses: {message}; check the dtypes of {spelling('inputs')} (and "
                                 f"{spelling('dtype')})")
