"""Rules for bitsandbytes' kernels (QLoRA's quantized base weights, ``--quantize-base``).

bitsandbytes registers its ops with fake kernels, so their outputs record as they are; what
the fake kernels cannot say is the memory a kernel allocates for itself while it runs, the
FLOPs (torch's flop counter knows only aten's ops), and how many columns LLM.int8's outlier
split keeps in 16 bits (a count that depends on the activations' values: a bound).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from graphmem.trace.rules.registry import ArgMeta, Bound, RuleKind, register

# bitsandbytes/backends/cuda/ops.py (0.50): at most this many rows of A, gemm_4bit always runs
# its fused kernel; past 1536 rows always the dequantize-then-linear path
_FUSED_ROWS = 4


@register("bitsandbytes::gemm_4bit.default", device="cuda")
def gemm_4bit_workspace(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """The 4-bit matmul on CUDA: for more than a few rows of A (every training step) it
    dequantizes the whole weight into a temporary in A's dtype, and with double quantization
    first its scales into two float32 temporaries, then runs F.linear
    (``_dequant_linear_fallback``).  Between 5 and 1536 rows bitsandbytes chooses per GPU
    architecture; assumed the dequantizing path there too (the larger of the two).
    """
    a: ArgMeta = args[0]
    shape_b = args[2]
    absmax_8bit = kwargs.get("absmax_8bit", args[7] if len(args) > 7 else None)
    rows = math.prod(a.shape[:-1])
    if rows <= _FUSED_ROWS:
        return 0
    scales = 2 * 4 * math.prod(absmax_8bit.shape) if isinstance(absmax_8bit, ArgMeta) else 0
    return int(math.prod(shape_b)) * a.dtype.itemsize + scales


@register("bitsandbytes::gemm_4bit.default", device="any", kind=RuleKind.FLOPS)
def gemm_4bit_flops(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """A (rows x K) times the (N x K) weight's transpose: 2 x rows x N x K, as for aten.mm."""
    a: ArgMeta = args[0]
    n, k = args[2]
    flops: int = 2 * math.prod(a.shape[:-1]) * n * k  # a size symbol stays one (no int())
    return flops


# LLM.int8 (bitsandbytes' Linear8bitLt with threshold > 0, transformers' default 6.0): every
# activation column holding a value of magnitude >= threshold is an outlier column, computed in
# 16 bits apart from the int8 matmul.  How many there are depends on the values: at most all
# K columns of the input (bitsandbytes/backends/default/ops.py, 0.50).

@register("bitsandbytes::int8_vectorwise_quant.default", device="any", kind=RuleKind.OUTPUT_BOUNDS)
def int8_vectorwise_quant_bound(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Bound:
    """A (rows x K) quantized row-wise: int8 of A's shape, a float32 scale per row, and the
    int64 indices of the outlier columns (at most K)."""
    a: ArgMeta = args[0]
    rows = math.prod(a.shape[:-1])
    return Bound(a.shape[-1], ((tuple(a.shape), torch.int8), ((rows,), torch.float32), ((None,), torch.int64)))


@register("bitsandbytes::int8_double_quant.default", device="any", kind=RuleKind.OUTPUT_BOUNDS)
def int8_double_quant_bound(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Bound:
    """As int8_vectorwise_quant, quantized both row- and column-wise: two int8 copies of A,
    float32 scales per row and per column, and the outlier columns' indices (at most K)."""
    a: ArgMeta = args[0]
    rows, k = math.prod(a.shape[:-1]), a.shape[-1]
    return Bound(k, ((tuple(a.shape), torch.int8), (tuple(a.shape), torch.int8), ((rows,), torch.float32),
                     ((k,), torch.float32), ((None,), torch.int64)))


@register("bitsandbytes::int8_mixed_scaled_mm.default", device="any", kind=RuleKind.OUTPUT_BOUNDS)
def int8_mixed_scaled_mm_bound(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Bound:
    """The int8 matmul plus the outlier columns in A's dtype: the output (rows x N) and the
    outlier columns of A it keeps for the backward (rows x count, count at most K)."""
    a: ArgMeta = args[0]
    ca: ArgMeta = args[1]
    cb: ArgMeta = args[2]
    return Bound(a.shape[-1], (((*ca.shape[:-1], cb.shape[0]), a.dtype), ((*a.shape[:-1], None), a.dtype)))


# On CUDA (the path MatMul8bitLt takes there, graphmem.trace.cuda_target.kernels), what bitsandbytes'
# int8 kernels allocate for themselves, read from bitsandbytes 0.50's source
# (backends/cuda/ops.py and backends/default/ops.py); not measured on a GPU.

@register("bitsandbytes::int8_vectorwise_quant.default", device="cuda")
def int8_vectorwise_quant_workspace(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """With a threshold, finding the outlier columns (``A.abs() >= threshold``) holds |A| in
    A's dtype (float16) and a bool mask, one byte per element, at once."""
    a: ArgMeta = args[0]
    threshold = kwargs.get("threshold", args[1] if len(args) > 1 else 0.0)
    return math.prod(a.shape) * (a.dtype.itemsize + 1) if threshold > 0 else 0


@register("bitsandbytes::int8_mixed_scaled_mm.default", device="cuda")
def int8_mixed_scaled_mm_workspace(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """The largest of its three steps, for A (rows x K), the int8 weight (N x K) and u outlier
    columns: dequantizing the weight's outlier columns (their int8 copy and two float32
    products, N x u x 9 bytes); the int8 matmul's int32 product and its float16 rescaling
    (rows x N x 6, plus the cast to A's dtype when that is not float16 and outliers follow),
    beside the dequantized columns in A's dtype; adding the outlier product, which makes a
    new output beside the int8 one."""
    a: ArgMeta = args[0]
    cb: ArgMeta = args[2]
    cols = kwargs.get("outlier_cols", args[5] if len(args) > 5 else None)
    rows, n, item = math.prod(a.shape[:-1]), cb.shape[0], a.dtype.itemsize
    u = math.prod(cols.shape) if isinstance(cols, ArgMeta) else 0
    dequantize = n * u * (1 + 4 + 4)
    cast = rows * n * item if u and a.dtype != torch.float16 else 0
    matmul = n * u * item + rows * n * (4 + 2) + cast
    add = n * u * item + rows * n * item if u else 0
    workspace: int = max(dequantize, matmul, add)
    return workspace
