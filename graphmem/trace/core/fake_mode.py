"""The FakeTensorMode every recording runs in, with graphmem's ``fake_kernel`` rules.

Input: the CPU rule table's fake kernels.  Output: the process's recording mode, or a mode
whose sizes may be symbols.  Knows nothing of models, steps or engines.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from graphmem._torch_api import (
    SYMBOLIC_REFERENCES,
    FakeTensorMode,
    OpOverload,
    ShapeEnv,
    tree_flatten,
    tree_map,
    unset_fake_temporarily,
)
from graphmem.trace.rules import rules_for
from graphmem.trace.rules.registry import ArgMeta

__all__ = ["recording_fake_mode", "symbolic_fake_mode"]


def _arg_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ArgMeta(tuple(value.shape), value.dtype, tuple(value.stride()))
    return value


class _FakeTensorMode(FakeTensorMode):
    """FakeTensorMode with some meta kernels replaced by graphmem's ``fake_kernel`` rules
    (graphmem.trace.rules): where torch's meta kernel refuses inputs the real kernel accepts.
    The rule sees metadata only; its answer becomes fake outputs on the inputs' device."""

    def __init__(self, kernels: Mapping[OpOverload, Any], shape_env: ShapeEnv | None = None) -> None:
        super().__init__(allow_non_fake_inputs=True, shape_env=shape_env)
        self._kernels = kernels

    # a higher-order op (FlexAttention's) finds its fake kernel by the mode's exact type, which
    # this subclass is not: it takes it through __torch_dispatch__, as FakeTensorMode's own does
    # (graphmem.trace.core.recorder records them as one op)
    supports_higher_order_operators = True

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _VIEWS:
            return self._view(func, types, args, kwargs)
        if any(isinstance(a, torch.UntypedStorage) for a in args):
            # an op given a storage (torch.load rebuilds each tensor with ``set_(storage, ...)``):
            # not through the dispatch cache, whose key would hold the storage, and so a loaded
            # checkpoint's memory, for the life of the process (a real one dies with its tensors)
            return self._dispatch_impl(func, types, args, kwargs or {})
        kernel = self._kernels.get(func)
        if kernel is None:
            reference = SYMBOLIC_REFERENCES.get(func) if self.shape_env is not None else None
            if reference is not None:
                with self:
                    return reference(*args, **(kwargs or {}))
            return super().dispatch(func, types, args, kwargs or {})
        device = next(t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        out = kernel(tree_map(_arg_meta, tuple(args)), tree_map(_arg_meta, dict(kwargs or {})))
        with self:
            return tree_map(lambda m: _made(m, device) if isinstance(m, ArgMeta) else m, out)


    def _view(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """``view`` with the strides the real kernel gives.  FakeTensor computes a view's
        strides in Python (torch._refs._reshape_view_helper), which differs from ATen's
        computeStride for dimensions of size 1 (a view of (1, 64, 4, 4) channels-last as
        (1, 64, 16): batch stride 1024, where the real kernel gives 64); and strides decide
        memory formats (an upsampling backward's output layout, whether autograd copies a
        gradient into its parameter's layout).  The C++ meta kernel computes them as the real
        one: the fake view is re-strided to its answer.  Sizes as symbols: left as is."""
        out = super().dispatch(func, types, args, kwargs or {})
        a = args[0]
        if not isinstance(out, torch.Tensor) or 1 not in out.shape or a.is_contiguous() or not _concrete(a, out):
            return out  # a contiguous input's view is contiguous both ways
        with unset_fake_temporarily():
            meta = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
            wanted = func(meta, *args[1:], **(kwargs or {})).stride()
        if wanted == out.stride():
            return out
        return super().dispatch(torch.ops.aten.as_strided.default, types,
                                (a, out.shape, wanted, a.storage_offset()), {})


def _made(meta: ArgMeta, device: torch.device) -> torch.Tensor:
    """A fake output as ``meta`` describes it (on a storage of ``storage_numel`` elements, if given)."""
    if meta.storage_numel is None:
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)
    return torch.empty(meta.storage_numel, dtype=meta.dtype, device=device).as_strided(meta.shape, meta.stride)


_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})


def _concrete(*tensors: torch.Tensor) -> bool:
    return all(type(n) is int for t in tensors for n in (*t.shape, *t.stride(), t.storage_offset()))


@functools.cache
def recording_fake_mode() -> FakeTensorMode:
    """The FakeTensorMode every recording runs in: it runs graphmem's ``fake_kernel`` rules in
    place of the meta kernels they replace.  A real tensor the model holds outside its
    parameters and buffers (torchvision's anchor generator keeps its cell anchors as a plain
    attribute) becomes a fake constant where an op uses it: every op's output is fake, so
    no new real memory is allocated.

    One per process, not one per recording: model code that caches a tensor by shape
    (``functools.lru_cache`` on rotary or position embeddings: DINOv3, SAM 3, MaskFormer)
    hands the tensor cached while recording inference to the training recording, and a fake
    tensor of another mode is refused ("Mixing fake modes").  Each recording still gets
    fresh fake parameters and inputs (``to_fake`` of new meta tensors), and the model code's
    caches are emptied before each recording (graphmem.trace.recording), so what it caches is made
    and counted in each mode's recording, as in a fresh process."""
    return _FakeTensorMode(rules_for("cpu").fake_kernels)  # fake tensors live on the CPU


def symbolic_fake_mode() -> FakeTensorMode:
    """A FakeTensorMode like ``recording_fake_mode``'s, with its own ShapeEnv: sizes may be
    symbols (``size_symbol``), and every decision taken on one is kept as a guard.  Ops whose
    output shape or value depends on values raise as in the concrete mode (no unbacked sizes)."""
    env = ShapeEnv(allow_scalar_outputs=False, allow_dynamic_output_shape_ops=False)
    mode = _FakeTensorMode(rules_for("cpu").fake_kernels, shape_env=env)
    return mode
