"""CUDA's autocast, applied to (fake) CPU tensors.

Used by stage 2 (trace) for ``--device cuda --amp bf16|fp16``.  The CUDA target is recorded
on fake CPU tensors (see ``graphmem/trace/cuda_target/kernels.py``), so the autocast that acts on them is CPU's,
and CPU's op lists are not CUDA's: on CUDA softmax, log_softmax, layer_norm, sum and exp
run in (or return) float32 where CPU leaves a bf16 input in bf16, and CUDA does not autocast
cat/stack where CPU casts their inputs first.  Those choices decide activation bytes.

``cuda_autocast(dtype)`` enables CPU autocast and, for its duration only, replaces the
``AutocastCPU`` dispatch-key kernel of

- every op the installed torch gives an ``AutocastCUDA`` kernel by a Python kernel that
  applies CUDA's cast policy for that op (``CUDA_POLICIES``), the way the C++
  ``WrapFunction_`` does: with the autocast key excluded, cast the arguments, call the op;
- every op with only an ``AutocastCPU`` kernel by a fallthrough: CUDA does not autocast it.

Input: the low-precision dtype.  Output: a context manager; on exit every override is
removed and the weight-cast cache is dropped, so plain CPU autocast is as before.

The dispatcher is process-wide: while a region is open, any thread with CPU autocast
enabled sees CUDA's lists.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from enum import StrEnum, unique
from functools import cache
from types import MappingProxyType
from typing import Any

import torch

from graphmem._torch_api import (
    OpOverload,
    destroy_library,
    dispatch_key_guard,
    is_cached_tensor,
    is_view,
    op_schema,
    ops_with_kernel_for,
)

__all__ = ["CUDA_POLICIES", "CastPolicy", "autocast_ops", "cuda_autocast", "cuda_autocast_lists"]


@unique
class CastPolicy(StrEnum):
    """``at::autocast::CastPolicy`` (aten/src/ATen/autocast_mode.h), plus the banned op."""

    LOWER_PRECISION_FP = "lower_precision_fp"  # cast floating args to the autocast dtype
    FP32 = "fp32"  # cast floating args to float32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # an unset `ScalarType? dtype` becomes float32
    FP32_APPEND_DTYPE = "fp32_append_dtype"  # call the overload that takes a dtype
    PROMOTE = "promote"  # cast floating args to the widest floating dtype among them
    BANNED = "banned"  # raises, as on CUDA


# CUDA's lists, from aten/src/ATen/autocast_mode.h (the installed torch ships it under
# torch/include/ATen/) and the registrations in aten/src/ATen/autocast_mode.cpp,
# TORCH_LIBRARY_IMPL(aten, Autocast, m).  Names are dispatcher names: "op" or "op.overload".
_LOWER_PRECISION_FP = (  # AT_FORALL_LOWER_PRECISION_FP, then KERNEL_CUDA(cudnn_convolution*)
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu",
    "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
    "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose",
)
_FP32 = (  # AT_FORALL_FP32
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
    "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
    "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist",
    "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
# fp32 ops registered in autocast_mode.cpp outside the macros by newer torch releases, kept
# where the installed torch has the op: linalg_matrix_sqrth (torch 2.14; under autocast on a
# fake CUDA tensor a float16 input gives a float32 result, as rsqrt's does)
FP32_OUTSIDE_THE_MACROS = tuple(name for name in ("linalg_matrix_sqrth",) if hasattr(torch.ops.aten, name))
# registered for AutocastCUDA by CUDA builds only (aten/src/ATen/cudnn/AutocastRNN.cpp: it casts
# a recurrent layer's input, state and weights to the low dtype and re-flattens the weights):
# not modelled, the CUDA target runs a recurrent layer under autocast in its own dtype
NOT_MODELLED = ("_cudnn_rnn",)
_FP32_SET_OPT_DTYPE = (  # AT_FORALL_FP32_SET_OPT_DTYPE
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: the overload without a dtype -> the one with it
_APPEND_DTYPE_REDISPATCH = MappingProxyType({
    "norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
})
_PROMOTE = (  # AT_FORALL_PROMOTE
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add",
)
_BANNED = ("binary_cross_entropy",)  # m.impl("aten::binary_cross_entropy", ..._banned)
# binary_cross_entropy_banned's message, verbatim
_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")

CUDA_POLICIES: Mapping[str, CastPolicy] = MappingProxyType({
    **dict.fromkeys(_LOWER_PRECISION_FP, CastPolicy.LOWER_PRECISION_FP),
    **dict.fromkeys(_FP32, CastPolicy.FP32),
    **dict.fromkeys(FP32_OUTSIDE_THE_MACROS, CastPolicy.FP32),
    **dict.fromkeys(_FP32_SET_OPT_DTYPE, CastPolicy.FP32_SET_OPT_DTYPE),
    **dict.fromkeys(_APPEND_DTYPE_REDISPATCH, CastPolicy.FP32_APPEND_DTYPE),
    **dict.fromkeys(_PROMOTE, CastPolicy.PROMOTE),
    **dict.fromkeys(_BANNED, CastPolicy.BANNED),
})

_AUTOCAST_CPU = "AutocastCPU"
_TENSOR, _OPTIONAL_TENSOR, _TENSOR_LIST = "Tensor", "Optional[Tensor]", "List[Tensor]"
_OPTIONAL_DTYPE = "Optional[ScalarType]"


@cache
def autocast_ops(dispatch_key: str) -> frozenset[str]:
    """The ops ("aten::softmax.int") the installed torch gives a kernel for ``dispatch_key``.

    Cached at the first call, which ``cuda_autocast`` makes before it overrides anything.
    """
    return ops_with_kernel_for(dispatch_key)


@cache
def _packet(name: str) -> OpOverload:
    """The aten OpOverload for "op" or "op.overload"."""
    base, _, overload = name.partition(".")
    packet: OpOverload = getattr(getattr(torch.ops.aten, base), overload or "default")
    return packet


# ---- cached_cast and the eligibility tests (autocast_mode.h / autocast_mode.cpp) ----------------

def _autocast_eligible(t: Any) -> bool:
    # is_autocast_eligible: a floating tensor on the autocast device (here the CPU that stands
    # in for the GPU; fake tensors report it too, or cuda where graphmem run shows the program
    # its GPU tensors so)
    return isinstance(t, torch.Tensor) and t.device.type in ("cpu", "cuda") and t.is_floating_point()


def _is_eligible(t: Any) -> bool:
    # is_eligible: is_autocast_eligible and not double
    return _autocast_eligible(t) and t.dtype != torch.float64


def _is_cached_tensor(t: torch.Tensor) -> bool:
    # at::caching::is_cached_tensor: tensors CUDA graph trees keep; never cast-cached
    return is_cached_tensor(t)


class _CastCache:
    """``cached_cast``: lower-precision casts of fp32 leaves that require grad (the weights)
    are made once per autocast region and held until it exits, as on CUDA.

    Keyed by tensor identity; the weak reference tells a live key from a reused id.
    """

    def __init__(self) -> None:
        self._casts: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def cast(self, to_type: torch.dtype, arg: Any) -> Any:
        if not _is_eligible(arg) or arg.dtype == to_type:
            return arg
        # can_try_cache in cached_cast (autocast_mode.cpp)
        if not (to_type == torch.get_autocast_dtype("cpu") and arg.dtype == torch.float32
                and arg.requires_grad and arg.is_leaf and not is_view(arg)
                and torch.is_autocast_cache_enabled() and not _is_cached_tensor(arg)
                and not torch.is_inference_mode_enabled()):
            return arg.to(to_type)
        hit = self._casts.get(id(arg))
        if hit is not None and hit[0]() is arg:
            return hit[1]
        with torch.enable_grad():  # the cached cast keeps its grad_fn even under no_grad
            casted = arg.to(to_type)
        self._casts[id(arg)] = (weakref.ref(arg), casted)
        return casted

    def clear(self) -> None:
        self._casts.clear()


# ---- the policies: each takes the bound arguments (schema name -> value) -------------------------

def _bind(packet: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments the dispatcher passed, by schema name (omitted defaults stay omitted)."""
    names = [a.name for a in op_schema(packet).arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _cast_all(packet: OpOverload, bound: dict[str, Any],
              cast: Callable[[Any], Any]) -> dict[str, Any]:
    # cached_cast's overloads: Tensor, optional<Tensor>, TensorList; anything else is passed as
    # is.  Last argument first: the casts are a pack expansion in a call's arguments, which the
    # GCC builds of torch evaluate right to left (plain CPU autocast casts F.linear's weight
    # before its input), so the casts are recorded in the real order
    out = dict(bound)
    for a in reversed(op_schema(packet).arguments):
        kind = str(a.type)
        if a.name not in bound or bound[a.name] is None:
            continue
        if kind in (_TENSOR, _OPTIONAL_TENSOR):
            out[a.name] = cast(bound[a.name])
        elif kind == _TENSOR_LIST:
            out[a.name] = [cast(t) for t in bound[a.name]]
    return out


def _voters(packet: OpOverload, bound: dict[str, Any]) -> Iterator[Any]:
    # prioritize's overloads: Tensor and TensorList; optional<Tensor> falls to the no-op template
    for a in op_schema(packet).arguments:
        kind, value = str(a.type), bound.get(a.name)
        if kind == _TENSOR:
            yield value
        elif kind == _TENSOR_LIST:
            yield from value or []


def _promote_type(packet: OpOverload, bound: dict[str, Any], lower: torch.dtype) -> torch.dtype:
    # promote_type/prioritize: double is ignored; float32 wins over the low dtype
    current = lower
    for t in _voters(packet, bound):
        if not _autocast_eligible(t) or t.dtype == torch.float64:
            continue
        if current == torch.float32 or t.dtype == torch.float32:
            current = torch.float32
        elif not (current == lower and t.dtype == lower):
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _set_opt_dtype(packet: OpOverload, bound: dict[str, Any]) -> dict[str, Any]:
    # set_opt_dtype: an optional<ScalarType> the caller left unset becomes float32
    out = dict(bound)
    for a in op_schema(packet).arguments:
        if str(a.real_type) == _OPTIONAL_DTYPE and out.get(a.name) is None:
            out[a.name] = torch.float32
    return out


def _append_dtype(packet: OpOverload, bound: dict[str, Any]) -> dict[str, Any]:
    # type_from_firstarg; the redispatch overload takes every argument explicitly
    first = op_schema(packet).arguments[0].name
    out = {a.name: bound.get(a.name, a.default_value) for a in op_schema(packet).arguments}
    out["dtype"] = torch.float32 if _is_eligible(bound[first]) else bound[first].dtype
    return out


def _run(name: str, policy: CastPolicy, bound: dict[str, Any], casts: _CastCache) -> Any:
    """One WrapFunction_<policy>::call for op ``name``, with the autocast key already excluded."""
    packet, lower = _packet(name), torch.get_autocast_dtype("cpu")
    if policy is CastPolicy.LOWER_PRECISION_FP:
        return packet(**_cast_all(packet, bound, lambda t: casts.cast(lower, t)))
    if policy is CastPolicy.FP32:
        return packet(**_cast_all(packet, bound, lambda t: casts.cast(torch.float32, t)))
    if policy is CastPolicy.FP32_SET_OPT_DTYPE:
        first = bound[op_schema(packet).arguments[0].name]
        return packet(**(_set_opt_dtype(packet, bound) if _is_eligible(first) else bound))
    if policy is CastPolicy.FP32_APPEND_DTYPE:
        return _packet(_APPEND_DTYPE_REDISPATCH[name])(**_append_dtype(packet, bound))
    if policy is CastPolicy.PROMOTE:
        to_type = _promote_type(packet, bound, lower)
        return packet(**_cast_all(packet, bound, lambda t: casts.cast(to_type, t)))
    raise RuntimeError(_BANNED_MESSAGE)


def _kernel(name: str, policy: CastPolicy, casts: _CastCache) -> Callable[..., Any]:
    """The Python kernel for op ``name`` under ``policy``, for the AutocastCPU key."""
    packet, no_autocast = _packet(name), dispatch_key_guard("AutocastCPU")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with no_autocast():  # as WrapFunction_'s no_autocast guard
            return _run(name, policy, _bind(packet, args, kwargs), casts)

    return kernel


# ---- registration ----------------------------------------------------------------------------------

class _Overrides:
    """The open regions' shared state: the dispatcher is global, so one set of overrides."""

    def __init__(self) -> None:
        self.depth = 0
        self.casts = _CastCache()
        self.libraries: dict[str, torch.library.Library] = {}  # namespace -> its overrides
        self.torch_clear: Callable[[], None] | None = None

    def install(self) -> None:
        """Override every AutocastCPU kernel; hook the cache into torch's cache clearing."""
        cpu_only = autocast_ops(_AUTOCAST_CPU) - {f"aten::{name}" for name in CUDA_POLICIES}
        try:
            with warnings.catch_warnings():  # "Overriding a previously registered kernel ..."
                warnings.simplefilter("ignore", UserWarning)
                for name, policy in CUDA_POLICIES.items():
                    kernel = _kernel(name, policy, self.casts)
                    self._library("aten").impl(name, kernel, _AUTOCAST_CPU)
                for qualified in sorted(cpu_only):
                    namespace, _, name = qualified.partition("::")
                    self._library(namespace).impl(
                        name, torch.library.fallthrough_kernel, _AUTOCAST_CPU)
        except BaseException:  # any failure, an interrupt too: undone and re-raised
            self.remove()
            raise
        # torch.autocast.__exit__ drops the C++ cast cache by calling torch.clear_autocast_cache()
        # when the nesting returns to 0 (torch/amp/autocast_mode.py); ours goes with it, so a
        # region torch opens itself (checkpoint's recompute) frees its casts as on CUDA
        self.torch_clear = torch.clear_autocast_cache
        torch.clear_autocast_cache = self._clear_both

    def remove(self) -> None:
        """Deregister every override (the dispatcher restores the kernels beneath)."""
        if self.torch_clear is not None:
            torch.clear_autocast_cache = self.torch_clear
            self.torch_clear = None
        for library in self.libraries.values():
            destroy_library(library)
        self.libraries = {}
        self.casts.clear()

    def _clear_both(self) -> None:
        if self.torch_clear is not None:
            self.torch_clear()
        self.casts.clear()

    def _library(self, namespace: str) -> torch.library.Library:
        if namespace not in self.libraries:
            library = torch.library.Library(namespace, "IMPL")
            self.libraries[namespace] = library
        return self.libraries[namespace]


_OVERRIDES = _Overrides()


@contextlib.contextmanager
def cuda_autocast_lists() -> Iterator[None]:
    """CUDA's op lists in place of CPU's for any CPU autocast region opened inside, no region.

    Wrap a whole training step in it when autocast regions open where the caller does not
    see them: non-reentrant checkpointing re-enters ``torch.autocast("cpu")`` for its
    recompute in backward.  Nests with itself and with ``cuda_autocast``.
    """
    if _OVERRIDES.depth == 0:
        _OVERRIDES.install()
    _OVERRIDES.depth += 1
    try:
        yield
    finally:
        _OVERRIDES.depth -= 1
        if _OVERRIDES.depth == 0:
            _OVERRIDES.remove()


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """``torch.autocast("cuda", dtype)`` as it would act on CUDA tensors, for (fake) CPU tensors.

    Enables ``torch.autocast("cpu", dtype=dtype)`` with CUDA's op lists in place of CPU's.
    Casts of fp32 weights are cached until the autocast nesting returns to 0, as torch does.

    Args:
        dtype: the low-precision dtype, ``torch.bfloat16`` or ``torch.float16``.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise AssertionError(f"cuda_autocast: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    with cuda_autocast_lists(), torch.autocast("cpu", dtype=dtype):
        yield
