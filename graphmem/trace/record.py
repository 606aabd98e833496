"""Recording a step, with a model's repeated blocks recorded once.

Input: what graphmem.trace.tracer.trace_step takes.  Output: its ``Trace``.  A model with a
stack of alike blocks (graphmem.trace.blocks) is recorded cut to its first four blocks and
the others are placed by offset (graphmem.trace.repeat); the cut recording checks itself
first, and any model it does not fit, a generation step, a parallel step other than FSDP's,
and any recording that fails cut is recorded whole.  ``GRAPHMEM_REPEATED_BLOCKS=0`` always records whole.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from graphmem import progress
from graphmem.job.parallel import ParallelSpec
from graphmem.job.spec import InputSpec
from graphmem.job.step import StepConfig
from graphmem.trace.blocks import Stack, cut_to, find_stack
from graphmem.trace.cuda_kernels import CudaKernels
from graphmem.trace.rank_fork import RankFork
from graphmem.trace.records import Trace
from graphmem.trace.repeat import KEEP, placed_calls, repeat_blocks, same_trace
from graphmem.trace.tracer import trace_step
from graphmem.workers import processes

__all__ = ["forks_ranks", "record_ranks", "record_step"]


def record_step(model: nn.Module, inputs: Sequence[InputSpec], *, mode: str = "train", **keywords: Any) -> Trace:
    """trace_step's Trace, recording a stack of alike blocks once where that gives the same trace."""
    stack = None
    if os.environ.get("GRAPHMEM_REPEATED_BLOCKS", "1") != "0" and mode in ("inference", "train") \
            and _per_block(keywords.get("parallel")):
        stack = find_stack(model)
    step: StepConfig | None = keywords.get("step")
    # checkpointing every k-th block makes k blocks the unit that repeats
    period = step.checkpoint_every if step is not None and step.checkpoint and mode == "train" else 1
    if stack is None or stack.length % period or stack.length <= KEEP * period:
        return trace_step(model, inputs, mode=mode, **keywords)
    progress.show(f"recording {KEEP * period} of the {stack.length} alike blocks of {stack.path or 'the model'}")
    kernels: CudaKernels | None = keywords.get("cuda")
    try:
        with cut_to(stack, KEEP * period):
            cut = trace_step(model, inputs, mode=mode, **keywords)
        if same_trace(repeat_blocks(cut, stack.path, KEEP * period, period=period, graph=False), cut):
            whole = repeat_blocks(cut, stack.path, stack.length, period=period)
            if kernels is not None:
                _count_placed_calls(kernels, cut, stack, period)
            return whole
    except Exception:  # Unrepeatable, or the cut model fails where the whole may not (blocks indexed by number)
        pass
    if kernels is not None:
        kernels.backends.clear()
        kernels.calls.clear()
    progress.show(f"recording all {stack.length} blocks of {stack.path or 'the model'}")
    return trace_step(model, inputs, mode=mode, **keywords)


def forks_ranks(parallel: ParallelSpec | None, ranks: Sequence[int]) -> bool:
    """Whether record_ranks records these ranks from one shared beginning: ZeRO-1 alone (DDP's
    ranks are alike; FSDP2, TP and PP ranks differ from the first op).  ``GRAPHMEM_FORK_RANKS=0``:
    never (each rank recorded on its own)."""
    return (parallel is not None and len(ranks) > 1 and {name for name, _ in parallel.degrees} == {"zero1"}
            and parallel.parallelize is None and hasattr(os, "fork")
            and os.environ.get("GRAPHMEM_FORK_RANKS", "1") != "0")


def record_ranks(model: nn.Module, inputs: Sequence[InputSpec], ranks: Sequence[int], **keywords: Any
                 ) -> list[tuple[Trace, dict[str, int] | None]]:
    """trace_step's Trace for each of ``ranks`` of a ZeRO-1 step (forks_ranks), with the attention
    kernels each chose on the CUDA target (``cuda``: counted anew for each).  The ranks share
    their recording up to the first optimizer step (graphmem.trace.rank_fork); the other ranks'
    traces come back without their fx graph."""
    kernels: CudaKernels | None = keywords.get("cuda")
    fork = RankFork(ranks[1:], at_once=processes())
    try:
        trace = trace_step(model, inputs, mode="train", rank=ranks[0], fork=fork, **keywords)
    except BaseException as exc:
        if fork.rank is not None:
            fork.send(exc)  # a child ends here
        fork.stop()
        raise
    backends = dict(kernels.backends) if kernels else None
    if fork.rank is not None:
        fork.send((replace(trace, fx=torch.fx.Graph()), backends))
    others = fork.gather()
    return [(trace, backends), *(others[r] for r in ranks[1:])]


def _count_placed_calls(kernels: CudaKernels, cut: Trace, stack: Stack, period: int) -> None:
    """The attention kernels chosen, counted as the whole model calls them."""
    times = placed_calls(cut, stack.path, stack.length, [position for _, position in kernels.calls], period)
    kernels.backends.clear()
    for (backend, _), n in zip(kernels.calls, times, strict=True):
        if n:
            kernels.backends[backend] = kernels.backends.get(backend, 0) + n


def _per_block(parallel: ParallelSpec | None) -> bool:
    """Whether the parallel engine treats each block alone: FSDP2 shards each block's own
    parameters.  DDP's gradient buckets and ZeRO's partition of the optimizer state span the
    whole model, tensor and pipeline parallelism cut it otherwise: those are recorded whole."""
    return parallel is None or ({name for name, _ in parallel.degrees} == {"fsdp"} and parallel.parallelize is None)
