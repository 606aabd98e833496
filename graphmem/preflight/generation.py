"""The plan's rows for generation with a KV cache (``--generate``): the cache in a smaller dtype.

Input: a ``PlanContext`` whose baseline is a generation report.  Output: formula rows: the
analysed peaks of the prefill and of the last decode step with the analysed cache's bytes
rescaled to the other dtype.

The formula: a cache of ``kv`` bytes in elements of ``size`` bytes takes ``kv x new / size`` in
elements of ``new`` bytes (bf16/fp16: 2; fp8, as vLLM's ``--kv-cache-dtype fp8``: 1, with one
scale per layer, not counted).  The decode step holds the whole cache (prompt + new tokens);
the prefill holds the prompt's share of it.  Attention kernels that read an fp8 cache are
assumed to dequantize on the fly (no full-precision copy).
"""

from __future__ import annotations

import math

from graphmem.preflight.rows import Analysed, PlanContext, formula_row

__all__ = ["kv_cache_rows"]

_SIZES = {"bfloat16": 2, "float8": 1}


def kv_cache_rows(ctx: PlanContext) -> list[Analysed | str]:
    """The KV cache in bf16 (when the model's is fp32) and in fp8 (formula)."""
    g = ctx.base.report.generate
    if g is None or not g.kv_cache_bytes:
        return []
    size = ctx.facts.float_bytes  # the cache is in the model's dtype
    overhead = ctx.base.peak_bytes - max(g.prefill_peak_bytes, g.decode_peak_bytes)  # CUDA allocator
    prompt_kv = g.kv_cache_bytes * g.prompt_tokens // (g.prompt_tokens + g.new_tokens)
    rows: list[Analysed | str] = []
    for name, new in _SIZES.items():
        if new >= size or (name == "bfloat16" and not ctx.bf16):
            continue
        peak = max(g.prefill_peak_bytes - _saved(prompt_kv, size, new),
                   g.decode_peak_bytes - _saved(g.kv_cache_bytes, size, new))
        note = ("the cache's bytes from this analysis, rescaled" if name == "bfloat16" else
                "the cache's bytes from this analysis at 1 byte per value (vLLM --kv-cache-dtype fp8); "
                "per-layer scales not counted")
        rows.append(formula_row(ctx, {"kv_cache": name}, peak + overhead, note=note))
    return rows


def _saved(kv: int, size: int, new: int) -> int:
    """Bytes saved by storing ``kv`` bytes of ``size``-byte values in ``new`` bytes each."""
    return kv - math.ceil(kv * new / size)
