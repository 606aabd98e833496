"""Rules for bitsandbytes' 4-bit kernels (QLoRA's quantized base weights, ``--quantize-base``).

bitsandbytes registers its ops with fake kernels, so their outputs record as they are; what
the fake kernels cannot say is the memory a kernel allocates for itself while it runs, and
the FLOPs (torch's flop counter knows only aten's ops).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from graphmem.trace.rules.registry import ArgMeta, register

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


@register("bitsandbytes::gemm_4bit.default", device="any", kind="flops")
def gemm_4bit_flops(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """A (rows x K) times the (N x K) weight's transpose: 2 x rows x N x K, as for aten.mm."""
    a: ArgMeta = args[0]
    n, k = args[2]
    flops: int = 2 * math.prod(a.shape[:-1]) * n * k  # a size symbol stays one (no int())
    return flops
