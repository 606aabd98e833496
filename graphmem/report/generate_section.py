"""Stage 4: the --generate report: prefill and decode peaks and the KV cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tabulate import tabulate

from graphmem.job.option import spelling
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
    verdict = _gpu_verdict(report, gen, fmt)
    return "\n\n".join([head, tabulate(rows, tablefmt="simple"), *verdict, *(f"Assumed: {n}" for n in notes)]) + "\n"


def _gpu_verdict(report: MemoryReport, gen: GenerateReport, fmt: Callable[[int], str]) -> list[str]:
    """On the CUDA target: whether the higher step fits the GPU's memory (graphmem check
    --generate gives the same answer with a budget and an exit code)."""
    if report.gpu is None or gen.prefill.allocator is None or gen.decode.allocator is None:
        return []
    peak = max(gen.prefill.allocator.allocated_peak_bytes, gen.decode.allocator.allocated_peak_bytes)
    total = report.gpu.total_memory_bytes
    if peak <= total:
        return [f"Fits the {report.gpu.name}: allocated peak {fmt(peak)} of {fmt(total)} "
                f"(graphmem check {spelling('generate')} gives a verdict with a budget and an exit code)"]
    return [f"DOES NOT FIT the {report.gpu.name}: allocated peak {fmt(peak)} is more than its {fmt(total)}; "
            f"a smaller {spelling('batch')}, a shorter prompt or more GPUs are needed"]


def generate_json(report: MemoryReport, gen: GenerateReport) -> dict[str, Any]:
    """The ``generate`` object of the JSON document."""
    return {"prompt_tokens": gen.prompt_tokens, "new_tokens": gen.new_tokens, "batch": gen.batch,
            "params_bytes": gen.prefill.params_bytes, "prefill_peak_bytes": gen.prefill_peak_bytes,
            "decode_peak_bytes": gen.decode_peak_bytes, "kv_cache_bytes": gen.kv_cache_bytes,
            "prefill": cuda_json(report, gen.prefill),
            "decode_including_cache_fill": cuda_json(report, gen.decode),
            "assumptions": sorted(set(gen.prefill.assumptions) | set(gen.decode.assumptions))}
