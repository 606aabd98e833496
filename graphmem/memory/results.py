"""The analysis results: categories, lifetimes, peaks and the frozen reports.

Every result is a frozen, slotted dataclass, complete when built.  Sizes are int bytes
named ``*_bytes``; positions are int op indices ("steps").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum, unique

import torch

from graphmem.cuda.allocator import AllocatorStats
from graphmem.cuda.gpus import GPU
from graphmem.job.finetune import TrainedParameters
from graphmem.records import FileChange, Trace

__all__ = ["Category", "Lifetime", "PeakInfo", "PhasePeak", "ModeReport", "RankReport", "GenerateReport",
           "MemoryReport", "with_graph", "without_graphs"]


@unique
class Category(StrEnum):
    """The one category each live byte is reported under."""

    PARAMETER = "parameters"
    BUFFER = "buffers"
    INPUT = "inputs"
    ACTIVATION = "activations"
    TEMPORARY = "temporaries"
    OUTPUT = "outputs"
    GRADIENT = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    COMMUNICATION = "communication"  # --parallel: gradient buckets, all-gathered parameters, reduce-scatter inputs

@dataclass(frozen=True, slots=True)
class Lifetime:
    """Stage 3a's output for one storage: live from ``start`` to ``end`` (op indices,
    inclusive; ``start`` -1 means before the first op)."""

    sid: int
    nbytes: int
    start: int
    end: int
    category: Category

@dataclass(frozen=True, slots=True)
class PeakInfo:
    """Where a peak happens."""

    step: int
    op: str
    module: str
    phase: str
    iteration: int  # 0-based here; people (text and JSON) count from 1

    @property
    def op_name(self) -> str:
        """The op for people: ``relu`` for ``aten.relu.default`` (namespace and overload dropped)."""
        parts = self.op.split(".")
        return parts[1] if len(parts) == 3 else self.op

@dataclass(frozen=True, slots=True)
class PhasePeak:
    """The highest live bytes while ops of one phase run."""

    phase: str
    peak_bytes: int
    step: int

@dataclass(frozen=True, slots=True)
class ModeReport:
    """Stage 3b's output for one mode (inference or train)."""

    mode: str
    optimizer: str | None
    peak_bytes: int
    peak: PeakInfo
    breakdown: Mapping[Category, int]
    phases: tuple[PhasePeak, ...]
    timeline: tuple[int, ...]
    params_bytes: int
    buffers_bytes: int
    inputs_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    num_ops: int
    unmodeled_ops: tuple[str, ...]
    trace: Trace
    lifetimes: tuple[Lifetime, ...]
    iteration_peaks: tuple[int, ...]
    flops: int
    recompute_flops: int
    assumptions: tuple[str, ...]
    allocator: AllocatorStats | None = None  # CUDA target: the caching allocator's view
    sdpa_backends: Mapping[str, int] | None = None  # CUDA target: attention kernels chosen
    ranks: tuple[RankReport, ...] = ()  # --parallel: every distinct rank, the highest first (this one)

    @property
    def budget_peak_bytes(self) -> int:
        """The peak a budget is compared with: on the CUDA target what
        torch.cuda.max_memory_allocated() would say, else the tensor bytes at the peak."""
        return self.allocator.allocated_peak_bytes if self.allocator is not None else self.peak_bytes


@dataclass(frozen=True, slots=True)
class RankReport:
    """--parallel: one rank whose memory can differ from the others', and the ranks alike to it."""

    rank: int
    ranks: tuple[int, ...]
    report: ModeReport

@dataclass(frozen=True, slots=True)
class GenerateReport:
    """Inference with a KV cache: the prefill's peak and the last decode step's peak."""

    prompt_tokens: int
    new_tokens: int
    batch: int
    prefill_peak_bytes: int
    decode_peak_bytes: int
    kv_cache_bytes: int  # after the last step: prompt + new tokens
    prefill: ModeReport
    decode: ModeReport  # its trace also holds the forward that fills the cache

@dataclass(frozen=True, slots=True)
class MemoryReport:
    """What ``graphmem.analyze`` returns."""

    target: str
    device: str
    inputs: tuple[str, ...]
    inference: ModeReport | None
    train: ModeReport | None
    train_without_checkpoint: ModeReport | None = None  # the --checkpoint what-if's baseline
    gpu: GPU | None = None  # CUDA target: the GPU preset
    generate: GenerateReport | None = None  # --generate: inference with a KV cache
    parallel: str | None = None  # --parallel: the strategies and degrees, e.g. "fsdp=8"
    loss: str | None = None  # training: the --loss the step used
    trained: TrainedParameters | None = None  # training: how many parameters train (--freeze, --lora)
    program: str | None = None  # graphmem run: the command that ran (``target``: its first model's class)
    program_failed: str | None = None  # graphmem run: how the program failed after recording steps
    program_files: tuple[FileChange, ...] = ()  # graphmem run: what it did to files (in its own layer)

    @property
    def ratio(self) -> float | None:
        """Training peak over inference peak, when both were analysed."""
        if self.inference is None or self.train is None or self.inference.peak_bytes == 0:
            return None
        return self.train.peak_bytes / self.inference.peak_bytes



def with_graph(mode: ModeReport, fx: torch.fx.Graph | Callable[[], torch.fx.Graph]) -> ModeReport:
    """``mode`` with its trace's fx graph (or what builds it) set to ``fx``, and each rank's left out."""
    ranks = tuple(replace(r, report=with_graph(r.report, torch.fx.Graph())) for r in mode.ranks)
    return replace(mode, trace=replace(mode.trace, fx=fx), ranks=ranks)


def without_graphs(report: MemoryReport) -> MemoryReport:
    """``report`` with every trace's fx graph left out (a graph does not pickle: a report that
    comes back from a worker process reads bytes, not graphs)."""
    def maybe(mode: ModeReport | None) -> ModeReport | None:
        return with_graph(mode, torch.fx.Graph()) if mode is not None else None
    generate = report.generate
    if generate is not None:
        generate = replace(generate, prefill=with_graph(generate.prefill, torch.fx.Graph()),
                           decode=with_graph(generate.decode, torch.fx.Graph()))
    return replace(report, inference=maybe(report.inference), train=maybe(report.train),
                   train_without_checkpoint=maybe(report.train_without_checkpoint), generate=generate)
