"""Stage 3, composed: one recorded ``Trace`` to its ``ModeReport`` (pure).

Input: a trace, the storage release policy, the ops the target's rules model and, on a GPU,
the GPU preset with its allocator settings (``CudaSetup``).  Output: the liveness pass
(``liveness``), the mode report (``mode_report``) and on a GPU the caching allocator's view
(``cuda_replay``) with NCCL's own buffers, in that order; ranks ordered highest peak first.
The same for a model analysed and for a program run.  Knows nothing of how the trace was
recorded.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace

from graphmem.cuda.alloc_conf import AllocatorConfig, alloc_conf_from_environment, parse_alloc_conf
from graphmem.cuda.gpus import GPU, get_gpu
from graphmem.cuda.nccl import nccl_buffer_bytes
from graphmem.job.parallel import ParallelSpec
from graphmem.memory.cuda_replay import model_cuda_allocator
from graphmem.memory.liveness import compute_lifetimes
from graphmem.memory.mode_report import build_mode_report
from graphmem.memory.results import MemoryReport, ModeReport, RankReport
from graphmem.records import Trace

__all__ = ["CudaSetup", "allocator_again", "analyse", "highest_first"]


@dataclass(frozen=True, slots=True)
class CudaSetup:
    """A CUDA target as the memory model needs it: the GPU preset and its caching allocator's
    settings (PYTORCH_CUDA_ALLOC_CONF)."""

    gpu: GPU
    allocator: AllocatorConfig

    @classmethod
    def of(cls, gpu: str, alloc_conf: str | None) -> CudaSetup:
        """The preset named ``gpu``, the settings ``alloc_conf`` (None: the environment's).

        Raises:
            UserInputError: an unknown GPU or unreadable settings.
        """
        text = alloc_conf_from_environment() if alloc_conf is None else alloc_conf
        return cls(get_gpu(gpu), parse_alloc_conf(text))


def analyse(trace: Trace, *, policy: str, modeled: Collection[str], cuda: CudaSetup | None = None,
            parallel: ParallelSpec | None = None, communicators: int = 0,
            sdpa_backends: Mapping[str, int] | None = None, notes: tuple[str, ...] = ()) -> ModeReport:
    """The trace's liveness (``policy``), its mode report, and on a GPU the caching allocator.

    Args:
        trace: stage 2's output.
        policy: storage release policy (graphmem.memory.liveness).
        modeled: names of the ops with a scratch rule on the target.
        cuda: the CUDA target; None for the CPU (no allocator).
        parallel: the job's parallelism; it sizes NCCL's buffers.
        communicators: a program's process groups of more than one rank (NCCL's buffers, one
            set each), when ``parallel`` is None.
        sdpa_backends: on a GPU, the attention kernels the recording chose (calls each).
        notes: assumptions added to the trace's.

    Returns:
        The ModeReport; on a GPU with ``allocator`` and ``sdpa_backends``.  Sizes in bytes.
    """
    report = build_mode_report(trace, compute_lifetimes(trace, policy), set(modeled))
    report = replace(report, assumptions=(*report.assumptions, *notes))
    if cuda is None:
        return report
    stats = model_cuda_allocator(report, cuda.gpu, cuda.allocator, parallel=parallel)
    if communicators:  # NCCL's own buffers, one set per communicator, outside the allocator
        stats = replace(stats, nccl_buffer_bytes=nccl_buffer_bytes(communicators))
    return replace(report, allocator=stats, sdpa_backends=dict(sdpa_backends or {}))


def highest_first(ranks: Iterable[RankReport], note: str | None = None) -> ModeReport:
    """The report of the rank with the highest peak (the lowest rank among equals), holding
    every rank's, highest first; ``note`` added to its assumptions."""
    ordered = sorted(ranks, key=lambda r: (-r.report.budget_peak_bytes, r.rank))
    first = ordered[0].report
    assumptions = first.assumptions if note is None else (*first.assumptions, note)
    return replace(first, ranks=tuple(ordered), assumptions=assumptions)


def allocator_again(report: MemoryReport, cuda: CudaSetup) -> MemoryReport:
    """A report on a GPU with the caching allocator modelled again under ``cuda`` (NCCL's buffers
    kept): the rank shown first is again the one with the highest peak."""
    train = report.train
    assert train is not None, "allocator_again: a report with a training step"

    def again(mode: ModeReport) -> ModeReport:
        nccl = mode.allocator.nccl_buffer_bytes if mode.allocator is not None else 0
        stats = model_cuda_allocator(mode, cuda.gpu, cuda.allocator)
        return replace(mode, allocator=replace(stats, nccl_buffer_bytes=nccl))

    if not train.ranks:
        return replace(report, train=again(train))
    ranks = highest_first(replace(r, report=again(r.report)) for r in train.ranks)
    return replace(report, train=replace(ranks, assumptions=train.assumptions))
