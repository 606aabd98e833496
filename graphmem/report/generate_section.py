"""Stage 4: the --generate report: prefill and decode peaks and the KV cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tabulate import tabulate

from graphmem.memory.results import GenerateReport, MemoryReport
from graphmem.report.cuda_section import cuda_json
from graphmem.report.header import render_header

__all__ = ["generate_table", "generate_json"]


def generate_table(report: MemoryReport, gen: GenerateReport, fmt: Callable[[int], str]) -> str:
    """The generation numbers as a table, with the allocator's view on the CUDA target."""
    rows = [["parameters", fmt(gen.prefill.params_bytes)],
            [f"prefill peak ({gen.prompt_tokens} tokens)", fmt(gen.prefill_peak_bytes)],
            [f"decode peak (last step, cache of {gen.prompt_tokens + gen.new_tokens - 1} tokens)",
             fmt(gen.decode_peak_bytes)],
            [f"KV cache at the end ({gen.prompt_tokens + gen.new_tokens} tokens)", fmt(gen.kv_cache_bytes)],
            ["KV cache per token", fmt(gen.kv_cache_bytes // ((gen.prompt_tokens + gen.new_tokens) * gen.batch))
             + " per sequence"]]
    for name, part in (("prefill", gen.prefill), ("decode", gen.decode)):
        if part.allocator is not None:
            label = "prefill" if name == "prefill" else "cache fill + decode step"
            rows.append([f"{label}: allocated / reserved peak (CUDA)",
                         f"{fmt(part.allocator.allocated_peak_bytes)} / {fmt(part.allocator.reserved_peak_bytes)}"])
    head = render_header("graphmem analyze", report.target, (), report.device,
                         gpu=report.gpu.name if report.gpu else None,
                         mode=f"generation of {gen.new_tokens} tokens after a {gen.prompt_tokens}-token prompt, "
                              f"batch {gen.batch}", report=report, parallel=report.parallel, fmt=fmt)
    notes = sorted(set(gen.prefill.assumptions) | set(gen.decode.assumptions))
    return "\n\n".join([head, tabulate(rows, tablefmt="simple"), *(f"Assumed: {n}" for n in notes)]) + "\n"


def generate_json(report: MemoryReport, gen: GenerateReport) -> dict[str, Any]:
    """The ``generate`` object of the JSON document."""
    return {"prompt_tokens": gen.prompt_tokens, "new_tokens": gen.new_tokens, "batch": gen.batch,
            "params_bytes": gen.prefill.params_bytes, "prefill_peak_bytes": gen.prefill_peak_bytes,
            "decode_peak_bytes": gen.decode_peak_bytes, "kv_cache_bytes": gen.kv_cache_bytes,
            "prefill": cuda_json(report, gen.prefill),
            "decode_including_cache_fill": cuda_json(report, gen.decode),
            "assumptions": sorted(set(gen.prefill.assumptions) | set(gen.decode.assumptions))}
