"""What an analysed step needs from its device: the one number every pre-flight answer
compares with a budget (``check``, ``max-batch`` / ``max-seq``, each ``plan`` row, the sweep).

Input: a ``MemoryReport`` and the mode compared.  Output: a frozen ``Footprint``.  Pure.

The rule:
  - CPU target: the tensor bytes at the peak (exact against real CPU execution).
  - CUDA target: the caching allocator's *reserved* peak (``torch.cuda.max_memory_reserved``:
    the segments it must obtain from the device, which the allocated peak
    ``max_memory_allocated`` does not show: cached blocks too small or too split to reuse)
    plus what lives on the same GPU outside the allocator: the CUDA context
    (graphmem.cuda.gpus.CUDA_CONTEXT_BYTES) and, with ``--parallel``, NCCL's own buffers
    (graphmem.cuda.nccl).  The budget (a GPU's ``total_memory`` by default) must hold all of
    it: a job whose allocated peak fits but whose reserved peak does not fails with an
    out-of-memory error once the allocator cannot find a segment.
  - ``check --metric`` may compare another of the CUDA target's numbers (``compared_bytes``):
    ``allocated`` (the allocated peak plus what lives outside the allocator: the floor, what the
    GPU would hold if the allocator cached nothing), ``reserved`` (the rule above, the default)
    or ``nvidia-smi`` (the nvidia-smi estimate: reserved + CUDA context + NCCL buffers, which is
    the rule above in nvidia-smi's terms: the same bytes today).
  - With ``--parallel``: the rank that needs the most (each distinct rank is analysed).
  - With ``--generate``: the higher of the prompt's prefill and the last decode step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from graphmem.cuda.alloc_conf import alloc_conf_from_environment
from graphmem.memory.results import MemoryReport, ModeReport

__all__ = ["Footprint", "compared_mode", "expandable_conf", "footprint_of", "needed_bytes"]

_EXPANDABLE_RE = re.compile(r"\s*expandable_segments\s*:\s*[A-Za-z]*\s*(,|$)")


@dataclass(frozen=True, slots=True)
class Footprint:
    """One analysis's bytes as a budget sees them.

    Attributes:
        peak_bytes: CPU: the tensor bytes at the peak; CUDA: the allocated peak.
        reserved_peak_bytes: CUDA: the reserved peak; None on the CPU target.
        cuda_context_bytes: CUDA: the CUDA context's estimate for the GPU (0 on CPU).
        nccl_buffer_bytes: CUDA with --parallel: NCCL's buffers on the GPU (else 0).
        expandable_segments: CUDA: the allocator ran with expandable segments.
        rank: --parallel: the rank these bytes are of (None without).
        ranks: --parallel: the ranks whose memory is the same as ``rank``'s.
    """

    peak_bytes: int
    reserved_peak_bytes: int | None = None
    cuda_context_bytes: int = 0
    nccl_buffer_bytes: int = 0
    expandable_segments: bool = False
    rank: int | None = None
    ranks: tuple[int, ...] = ()

    @property
    def cuda(self) -> bool:
        return self.reserved_peak_bytes is not None

    @property
    def outside_bytes(self) -> int:
        """On the GPU but outside PyTorch's allocator: the CUDA context and NCCL's buffers."""
        return self.cuda_context_bytes + self.nccl_buffer_bytes

    @property
    def needed_bytes(self) -> int:
        """What the budget is compared with: CPU the peak; CUDA reserved + outside the allocator."""
        return self.peak_bytes if self.reserved_peak_bytes is None else self.reserved_peak_bytes + self.outside_bytes

    @property
    def nvidia_smi_bytes(self) -> int:
        """CUDA: what nvidia-smi would show for the process (``graphmem.cuda.gpus.nvidia_smi_estimate``:
        the reserved peak + CUDA context + NCCL buffers); CPU: the peak."""
        return self.peak_bytes if self.reserved_peak_bytes is None else self.reserved_peak_bytes + self.outside_bytes

    def compared_bytes(self, metric: str) -> int:
        """The bytes ``check --metric`` compares with the budget (``graphmem.preflight.budget.METRICS``);
        the CPU target has one number, its peak, whatever the metric."""
        if self.reserved_peak_bytes is None:
            return self.peak_bytes
        by_metric = {"allocated": self.allocated_needed_bytes, "reserved": self.needed_bytes,
                     "nvidia-smi": self.nvidia_smi_bytes}
        if metric not in by_metric:
            raise AssertionError(f"Footprint.compared_bytes: unknown metric {metric!r}; "
                                 f"expected one of {tuple(by_metric)}")
        return by_metric[metric]

    @property
    def allocated_needed_bytes(self) -> int:
        """The allocated peak plus what lives outside the allocator: what the GPU would hold if
        the allocator kept no byte more than the tensors (CPU: the peak)."""
        return self.peak_bytes + self.outside_bytes


def compared_mode(report: MemoryReport, mode: str) -> ModeReport:
    """The mode whose peak is compared: train or inference; with --generate, the higher of the
    prompt's prefill and the last decode step (on the CUDA target the decode's allocator peak
    also covers the forward that fills its cache: an upper bound)."""
    if report.generate is not None:
        g = report.generate
        return max((g.prefill, g.decode), key=lambda m: _mode_footprint(report, m).needed_bytes)
    found = report.train if mode == "train" else report.inference
    if found is None:
        raise AssertionError(f"compared_mode: the report has no {mode} result")
    return found


def footprint_of(report: MemoryReport, mode: str) -> Footprint:
    """The bytes of ``report``'s ``mode`` a budget is compared with (see the module docstring)."""
    found = compared_mode(report, mode)
    if found.allocator is None and report.generate is not None:  # the decode step, not its cache fill
        g = report.generate
        return Footprint(peak_bytes=max(g.prefill_peak_bytes, g.decode_peak_bytes))
    if not found.ranks:
        return _mode_footprint(report, found)
    each = [_mode_footprint(report, r.report, r.rank, r.ranks) for r in found.ranks]
    return max(each, key=lambda f: (f.needed_bytes, -(f.rank or 0)))


def needed_bytes(report: MemoryReport, mode: str) -> int:
    """``footprint_of(report, mode).needed_bytes``: the number every pre-flight answer compares."""
    return footprint_of(report, mode).needed_bytes


def _mode_footprint(report: MemoryReport, m: ModeReport, rank: int | None = None,
                    ranks: tuple[int, ...] = ()) -> Footprint:
    stats = m.allocator
    if stats is None or report.gpu is None:
        return Footprint(peak_bytes=m.peak_bytes, rank=rank, ranks=ranks)
    return Footprint(peak_bytes=stats.allocated_peak_bytes, reserved_peak_bytes=stats.reserved_peak_bytes,
                     cuda_context_bytes=report.gpu.cuda_context_bytes, nccl_buffer_bytes=stats.nccl_buffer_bytes,
                     expandable_segments=stats.config.expandable_segments, rank=rank, ranks=ranks)


def expandable_conf(alloc_conf: str | None) -> str:
    """The job's PYTORCH_CUDA_ALLOC_CONF (``alloc_conf``; None: the environment's, as the
    analysis reads it) with ``expandable_segments:True`` in place of any setting of it."""
    text = alloc_conf_from_environment() if alloc_conf is None else alloc_conf
    kept = _EXPANDABLE_RE.sub("", text).strip().rstrip(",").strip()
    return f"{kept},expandable_segments:True" if kept else "expandable_segments:True"
