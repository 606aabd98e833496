"""The only importer of torch private APIs.  Version checks live here.

Every private name graphmem relies on is imported once, in this file, so that a torch
upgrade that moves one breaks in one place with one clear message.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch._refs
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, guarding_hint_or_throw
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from graphmem.trace.rules import rules_for
from graphmem.trace.rules.registry import ArgMeta

__all__ = [
    "DATA_DEPENDENT_ERRORS",
    "DynamicOutputShapeException",
    "FakeTensorMode",
    "StorageWeakRef",
    "TorchDispatchMode",
    "UnsupportedOperatorException",
    "autograd_sequence_nr",
    "backward_keeping_modes",
    "count_flops",
    "current_autograd_node",
    "expr_of",
    "hint_of",
    "is_fake",
    "quiet_fake_tensor_logs",
    "recording_fake_mode",
    "shape_guards",
    "size_symbol",
    "storage_expired",
    "storage_key",
    "symbolic_fake_mode",
    "to_fake",
    "unset_fake_temporarily",
]

MIN_TORCH = (2, 4)
if tuple(int(p) for p in torch.__version__.split(".")[:2]) < MIN_TORCH:  # pragma: no cover
    raise ImportError(f"graphmem needs torch >= 2.4, found {torch.__version__}")

# Raised by FakeTensor when a model reads a tensor's value or creates a value-dependent shape.
DATA_DEPENDENT_ERRORS = (DataDependentOutputException, DynamicOutputShapeException)


def _arg_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ArgMeta(tuple(value.shape), value.dtype, tuple(value.stride()))
    return value


# ops whose C++ meta kernel reads sizes as numbers (a guard that pins a size symbol to its
# value) where torch's Python reference keeps them symbols; used where sizes are symbols
_SYMBOLIC_REFERENCES: dict[Any, Any] = {torch.ops.aten.constant_pad_nd.default: torch._refs.constant_pad_nd}


class _FakeTensorMode(FakeTensorMode):
    """FakeTensorMode with some meta kernels replaced by graphmem's ``fake_kernel`` rules
    (graphmem.trace.rules): where torch's meta kernel refuses inputs the real kernel accepts.
    The rule sees metadata only; its answer becomes fake outputs on the inputs' device."""

    def __init__(self, kernels: Mapping[torch._ops.OpOverload, Any], shape_env: ShapeEnv | None = None) -> None:
        super().__init__(allow_non_fake_inputs=True, shape_env=shape_env)
        self._kernels = kernels

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _VIEWS:
            return self._view(func, types, args, kwargs)
        kernel = self._kernels.get(func)
        if kernel is None:
            reference = _SYMBOLIC_REFERENCES.get(func) if self.shape_env is not None else None
            if reference is not None:
                with self:
                    return reference(*args, **(kwargs or {}))
            return super().dispatch(func, types, args, kwargs or {})
        device = next(t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        out = kernel(tree_map(_arg_meta, tuple(args)), tree_map(_arg_meta, dict(kwargs or {})))
        with self:
            return tree_map(lambda m: torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=device)
                            if isinstance(m, ArgMeta) else m, out)


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
    caches are emptied before each recording (graphmem.trace.tracer), so what it caches is made
    and counted in each mode's recording, as in a fresh process."""
    return _FakeTensorMode(rules_for("cpu").fake_kernels)  # fake tensors live on the CPU


def symbolic_fake_mode() -> FakeTensorMode:
    """A FakeTensorMode like ``recording_fake_mode``'s, with its own ShapeEnv: sizes may be
    symbols (``size_symbol``), and every decision taken on one is kept as a guard.  Ops whose
    output shape or value depends on values raise as in the concrete mode (no unbacked sizes)."""
    env = ShapeEnv(allow_scalar_outputs=False, allow_dynamic_output_shape_ops=False)
    mode = _FakeTensorMode(rules_for("cpu").fake_kernels, shape_env=env)
    return mode


MAX_SYMBOLIC_SIZE = 2**40  # the largest value a size symbol is assumed to take


def size_symbol(mode: FakeTensorMode, name: str, hint: int) -> torch.SymInt:
    """A new size symbol of ``mode``'s ShapeEnv whose value while recording is ``hint`` (>= 2:
    PyTorch specialises sizes 0 and 1)."""
    env = mode.shape_env
    assert env is not None and hint >= 2, "size_symbol: a symbolic mode and a hint >= 2"
    from torch._dynamo.source import ConstantSource  # here, not at import: torch._dynamo takes ~1 s to import

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
    return int(guarding_hint_or_throw(value)) if isinstance(value, torch.SymInt) else int(value)


def expr_of(value: Any) -> Any:
    """A size as a sympy expression of the size symbols (an int stays itself)."""
    return value.node.expr if isinstance(value, torch.SymInt) else int(value)


def shape_guards(mode: FakeTensorMode) -> tuple[Any, ...]:
    """The conditions on size symbols that the recording took as given (sympy booleans)."""
    env = mode.shape_env
    return tuple(guard.expr for guard in env.guards) if env is not None else ()


def to_fake(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Turn a meta tensor into a fake tensor on ``device`` with the same shape and strides.

    The fake tensor reports ``device`` (so device-dependent code paths take the target's
    branch) but keeps no memory: it is backed by a meta storage.
    """
    converter = mode.fake_tensor_converter
    return converter.from_meta_and_device(mode, meta, device)


def storage_key(t: torch.Tensor) -> tuple[int, StorageWeakRef, int]:
    """Identity, weak reference and size in bytes of the storage behind ``t``.

    Views and in-place results share their base's storage, so they share its key.
    """
    storage = t.untyped_storage()
    ref = StorageWeakRef(storage)
    return ref.cdata, ref, storage.nbytes()


# Whether the storage behind a StorageWeakRef's handle (``ref.cdata``) was freed: the C call
# that StorageWeakRef.expired makes, without its two Python frames (a hot loop).
storage_expired = torch.UntypedStorage._expired


def current_autograd_node() -> Any:
    """The autograd Node the engine is executing now, or None outside backward."""
    return torch._C._current_autograd_node()


def autograd_sequence_nr() -> int:
    """The sequence number the next autograd Node created on this thread will get."""
    return int(torch._C._autograd._get_sequence_nr())


@contextlib.contextmanager
def quiet_fake_tensor_logs() -> Iterator[None]:
    """Silence FakeTensor's own error log (a traceback per failing meta kernel); graphmem
    reports the failure itself, in one line.  Also bitsandbytes' warning, at every int8
    matmul, that it casts its input to float16 (true of the real run too, and not a memory
    fact the report leaves out: the cast is recorded)."""
    loggers = [logging.getLogger(name) for name in ("torch._subclasses.fake_tensor", "bitsandbytes")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (else a real one, or a meta tensor)."""
    return isinstance(t, FakeTensor)


def count_flops(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """FLOPs of one aten op from torch.utils.flop_counter's formulas (0 for ops it has none
    for): an int, or a SymInt where the sizes are symbols."""
    formula = flop_registry.get(func.overloadpacket)
    if formula is None:
        return 0
    try:
        value = formula(*args, **kwargs, out_val=out)
    except Exception:  # a formula that does not accept this overload's arguments
        return 0
    return value if isinstance(value, torch.SymInt) else int(value)


def backward_keeping_modes(loss: torch.Tensor) -> None:
    """``loss.backward()``, without passing through ``__torch_function__``.

    ``Tensor.backward`` is itself a torch function: an active TorchFunctionMode (graphmem's
    CUDA kernel choices) would be popped while it runs, and checkpoint's recompute inside
    backward would then run without it.  This is what torch.autograd.backward does
    (torch/autograd/__init__.py), minus the torch-function hop.
    """
    from torch.autograd import _make_grads
    from torch.autograd.graph import _engine_run_backward

    grads = _make_grads((loss,), (None,), is_grads_batched=False)
    _engine_run_backward((loss,), grads, False, False, (), allow_unreachable=True, accumulate_grad=True)
