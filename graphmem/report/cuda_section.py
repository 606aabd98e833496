"""Stage 4: the CUDA target's part of the reports: allocator peaks, the memory outside the
allocator (CUDA context; with --parallel, NCCL's buffers) and the GPU's budget."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tabulate import tabulate

from graphmem.cuda.gpus import nvidia_smi_estimate
from graphmem.memory.results import MemoryReport, ModeReport

__all__ = ["cuda_table", "cuda_json"]


def cuda_table(report: MemoryReport, modes: list[ModeReport], head: list[str],
               fmt: Callable[[int], str]) -> str | None:
    """Each metric a GPU reports, labelled with the counter it is: the allocated, active and
    reserved peaks, what lives outside the allocator, the nvidia-smi estimate (reserved + CUDA
    context + NCCL), and how much of the GPU that uses (docs/glossary.md: the gaps between them)."""
    gpu = report.gpu
    if gpu is None or not any(m.allocator for m in modes):
        return None
    stats = [m.allocator for m in modes]
    smi = [nvidia_smi_estimate(s.reserved_peak_bytes, gpu, s.nccl_buffer_bytes) if s else 0 for s in stats]
    nccl = report.parallel is not None
    rows = [["allocated peak (max_memory_allocated)"] + [fmt(s.allocated_peak_bytes) if s else "" for s in stats],
            ["peak active (active_bytes.all.peak)"] + [fmt(s.active_peak_bytes) if s else "" for s in stats],
            ["reserved peak (max_memory_reserved)"] + [fmt(s.reserved_peak_bytes) if s else "" for s in stats],
            ["CUDA context (outside the allocator)"] + [fmt(gpu.cuda_context_bytes) if s else ""
                                                                  for s in stats],
            *([["NCCL buffers (outside PyTorch's allocator)"] + [fmt(s.nccl_buffer_bytes) if s else "" for s in stats]]
              if nccl else []),
            [f"nvidia-smi estimate (+ CUDA context{', NCCL buffers' if nccl else ''})"] + [fmt(n) for n in smi],
            [f"share of {gpu.name} ({fmt(gpu.total_memory_bytes)})"]
            + [f"{n / gpu.total_memory_bytes:.1%}" for n in smi],
            ["left on the GPU"] + [fmt(gpu.total_memory_bytes - n) for n in smi],
            ["attention kernels"] + [", ".join(f"{k} x{v}" for k, v in (m.sdpa_backends or {}).items()) or "-"
                                     for m in modes]]
    return str("CUDA caching allocator (bytes rounded to blocks; cached segments)\n"
            + tabulate(rows, headers=head, tablefmt="simple"))


def cuda_json(report: MemoryReport, m: ModeReport) -> dict[str, Any]:
    """The CUDA keys of one mode's JSON object (empty for the CPU target)."""
    if m.allocator is None or report.gpu is None:
        return {}
    smi = nvidia_smi_estimate(m.allocator.reserved_peak_bytes, report.gpu, m.allocator.nccl_buffer_bytes)
    return {"allocated_peak_bytes": m.allocator.allocated_peak_bytes,
            "active_peak_bytes": m.allocator.active_peak_bytes,
            "reserved_peak_bytes": m.allocator.reserved_peak_bytes,
            "cuda_context_bytes": report.gpu.cuda_context_bytes,
            # --parallel: NCCL's own buffers, outside PyTorch's allocator (in the nvidia-smi estimate)
            **({"nccl_buffer_bytes": m.allocator.nccl_buffer_bytes} if report.parallel is not None else {}),
            "nvidia_smi_estimate_bytes": smi,
            "gpu_fraction_used": round(smi / report.gpu.total_memory_bytes, 6),
            "sdpa_backends": dict(m.sdpa_backends or {})}
