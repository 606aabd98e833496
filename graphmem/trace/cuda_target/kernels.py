"""The CUDA target's kernel choices, recorded on fake CPU tensors.

Used by stage 2 (trace) when ``device="cuda"``.  A CPU-only torch cannot run autograd on
fake ``cuda`` tensors (the engine asks for a CUDA device guard and the process aborts), so
graphmem records on fake CPU tensors and, where CUDA runs a different kernel than CPU,
calls the kernel CUDA would run.  Those kernels' meta implementations give the exact shapes,
dtypes and saved tensors.  The choices, each from the installed torch's source:

- ``scaled_dot_product_attention``: the backend PyTorch's ``select_sdp_backend``
  (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) picks for the GPU, dtype, head
  dim, mask and dropout, in the installed torch's priority order
  (torch's own priority order), or the one forced by ``--sdpa``.  Flash and
  memory-efficient attention keep the output and a per-row logsumexp (and RNG state), not
  the s x s matrix; math keeps the attention matrix.
- dropout: ``F.dropout`` on CUDA runs the fused ``native_dropout`` kernel, which saves a
  bool mask (1 byte per element) instead of CPU's float noise tensor
  (aten/src/ATen/native/Dropout.cpp, ``is_fused_kernel_acceptable``).
- optimizers: with ``--optimizer-impl auto`` PyTorch picks the foreach implementation for
  CUDA parameters (torch/optim/optimizer.py, ``_default_to_fused_or_foreach``).
- bitsandbytes' int8 matmul (an LLM.int8 base, ``--quantize-base int8``): on CPU a training
  step dequantizes the weight and runs F.linear (``MatMul8bitFp``); on CUDA it quantizes
  the activations to int8 and splits off the outlier columns (``MatMul8bitLt``), in training
  and inference (bitsandbytes/autograd/_functions.py ``matmul``, 0.50).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from graphmem._torch_api import sdp_priority_order
from graphmem.cuda.gpus import GPU
from graphmem.errors import UserInputError
from graphmem.job.option import spelling
from graphmem.patching import patched

__all__ = ["CudaKernels", "select_sdpa_backend"]

aten = torch.ops.aten
_ORDER = {1: "flash", 2: "efficient", 0: "math", 3: "cudnn"}  # torch's SDPBackend numbering
_HALF = (torch.float16, torch.bfloat16)


def _flash_ok(dtype: torch.dtype, head_dim: int, has_mask: bool, gpu: GPU) -> bool:
    # check_flash_attention_hardware_support (sm80+), check_tensor_dtype (fp16/bf16 only),
    # check_head_dim_size_flash (<= 256, multiple of 8), check_for_attn_mask (no mask)
    return gpu.compute_capability >= (8, 0) and dtype in _HALF and head_dim <= 256 \
        and head_dim % 8 == 0 and not has_mask


def _efficient_ok(dtype: torch.dtype, head_dim: int, gpu: GPU) -> bool:
    # check_mem_efficient_hardware_support (sm50+; bf16 needs sm80),
    # check_head_dim_size_mem_efficient (multiple of 8 for half, of 4 for fp32)
    if gpu.compute_capability < (5, 0) or (dtype == torch.bfloat16 and gpu.compute_capability < (8, 0)):
        return False
    return dtype in (*_HALF, torch.float32) and head_dim % (8 if dtype in _HALF else 4) == 0


def select_sdpa_backend(dtype: torch.dtype, head_dim: int, has_mask: bool, gpu: GPU,
                        requested: str = "auto") -> str:
    """The SDPA backend CUDA would run: ``flash``, ``efficient``, ``cudnn`` or ``math``.

    Raises:
        UserInputError: ``requested`` names a backend these inputs or this GPU cannot use.
    """
    usable = {"flash": _flash_ok(dtype, head_dim, has_mask, gpu),
              "efficient": _efficient_ok(dtype, head_dim, gpu),
              "cudnn": gpu.compute_capability >= (8, 0) and dtype in _HALF and head_dim <= 128,
              "math": True}
    if requested != "auto":
        if not usable[requested]:
            raise UserInputError(f"{spelling('sdpa')} {requested} cannot run {str(dtype).removeprefix('torch.')} "
                                 f"attention with head dim {head_dim}{' and a mask' if has_mask else ''} "
                                 f"on {gpu.name}; use {spelling('sdpa')} auto")
        return requested
    allowed = _allowed_now()
    for number in sdp_priority_order():
        name = _ORDER.get(number)
        if name and name != "cudnn" and usable[name] and allowed[name]:
            return name
    return "math"


def _allowed_now() -> dict[str, bool]:
    """The backends the program allows now: ``torch.nn.attention.sdpa_kernel(...)`` (or the
    ``torch.backends.cuda.enable_*_sdp`` switches) turn the others off, as select_sdp_backend
    checks them first; all allowed by default."""
    cuda = torch.backends.cuda
    return {"flash": cuda.flash_sdp_enabled(), "efficient": cuda.mem_efficient_sdp_enabled(),
            "cudnn": cuda.cudnn_sdp_enabled(), "math": True}


class CudaKernels(TorchFunctionMode):
    """Routes the calls whose CUDA kernel differs from CPU's to the CUDA kernel."""

    def __init__(self, gpu: GPU, sdpa: str = "auto") -> None:
        super().__init__()
        self.gpu, self.sdpa = gpu, sdpa
        self.backends: dict[str, int] = {}  # SDPA backend -> calls, for the report
        self.calls: list[tuple[str, int]] = []  # (SDPA backend, index of the op recorded next), in order
        self.position: Callable[[], int] = lambda: -1  # the recorder's next op index, set by the tracer
        self._routes: dict[Callable[..., Any], Callable[..., Any]] = {
            F.scaled_dot_product_attention: self._attention,
            F.dropout: self._dropout,
            torch.dropout: self._dropout,
        }

    def __enter__(self) -> CudaKernels:
        self._libraries = contextlib.ExitStack()
        self._libraries.enter_context(_bitsandbytes_int8_as_on_cuda())
        # called from inside a function torch hands to this mode (F.multi_head_attention_forward,
        # behind nn.MultiheadAttention and nn.Transformer*), where the mode is off: the name too
        sdpa = F.scaled_dot_product_attention
        self._libraries.enter_context(patched((F, "scaled_dot_product_attention",
                                               functools.partial(self._attention, sdpa))))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._libraries.close()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        route = self._routes.get(func)
        if route is None:
            return func(*args, **(kwargs or {}))
        return route(func, *args, **(kwargs or {}))

    def _dropout(self, func: Any, x: torch.Tensor, p: float = 0.5, training: bool = True,
                 inplace: bool = False) -> torch.Tensor:
        if not training or inplace or not 0 < p < 1 or x.numel() == 0:
            return func(x, p, training, inplace) if func is F.dropout else func(x, p, training)
        return torch.native_dropout(x, p, True)[0]

    def _attention(self, func: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        call = _Sdpa(*args, **kwargs)
        q, k, v, mask, dropout_p, is_causal, scale = (call.query, call.key, call.value, call.attn_mask,
                                                      call.dropout_p, call.is_causal, call.scale)
        backend = select_sdpa_backend(q.dtype, q.shape[-1], mask is not None, self.gpu, self.sdpa)
        self.backends[backend] = self.backends.get(backend, 0) + 1
        self.calls.append((backend, self.position()))
        if call.enable_gqa and k.shape[-3] != q.shape[-3]:  # the fused kernels take equal head counts
            repeat = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(repeat, -3), v.repeat_interleave(repeat, -3)
        if backend == "flash":
            outs = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)
        elif backend == "efficient":
            outs = aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, dropout_p, is_causal, scale=scale)
        elif backend == "cudnn":
            outs = aten._scaled_dot_product_cudnn_attention(
                q, k, v, mask, True, dropout_p, is_causal, False, scale=scale)
        else:
            outs = aten._scaled_dot_product_attention_math(q, k, v, mask, dropout_p, is_causal, None, scale=scale)
        out: torch.Tensor = outs[0]
        return out


@dataclass(frozen=True, slots=True)
class _Sdpa:
    """The arguments of one ``F.scaled_dot_product_attention`` call, by its own signature (its
    parameter names too: transformers 4.4x's GPT-NeoX passes ``query=``, ``key=``, ``value=``)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False


@contextlib.contextmanager
def _bitsandbytes_int8_as_on_cuda() -> Iterator[None]:
    """While recording, ``bitsandbytes.matmul`` (what Linear8bitLt calls) takes the path it
    takes for CUDA tensors: ``MatMul8bitLt`` in training too, where on CPU tensors (the fake
    ones here) it would take ``MatMul8bitFp``.  Nothing changes where bitsandbytes is not loaded."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None or not hasattr(bnb, "matmul"):
        yield
        return
    from bitsandbytes.autograd._functions import MatMul8bitLt, MatmulLtState

    def matmul(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None, state: Any = None,
               threshold: float = 0.0, bias: torch.Tensor | None = None) -> torch.Tensor:
        state = state or MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        result: torch.Tensor = MatMul8bitLt.apply(A, B, out, bias, state)
        return result

    with patched((bnb, "matmul", matmul)):
        yield
