"""Recording a step, with a model's repeated blocks recorded once.

Input: what graphmem.trace.recording.trace_step takes (a model and a ``Recording``).  Output:
its ``Trace``.  A model with a stack of alike blocks (graphmem.trace.repeat.blocks) is recorded
cut to its first four blocks and the others are placed by offset (graphmem.trace.repeat.place);
the cut recording checks itself first, and any model it does not fit, a generation step, a
parallel step other than FSDP's, and any recording that fails cut is recorded whole.
``GRAPHMEM_REPEATED_BLOCKS=0`` always records whole.
"""

from __future__ import annotations

import os

from torch import nn

from graphmem.job.fallback import first_line
from graphmem.job.parallel import ParallelSpec
from graphmem.process import progress
from graphmem.records import Trace
from graphmem.trace.cuda_target.kernels import CudaKernels
from graphmem.trace.recording import Recording, trace_step
from graphmem.trace.repeat.blocks import Stack, cut_to, find_stack
from graphmem.trace.repeat.place import KEEP, placed_calls, repeat_blocks, same_trace

__all__ = ["record_step"]


def record_step(model: nn.Module, recording: Recording, *, cuda: CudaKernels | None = None) -> Trace:
    """trace_step's Trace, recording a stack of alike blocks once where that gives the same trace."""
    stack = None
    if os.environ.get("GRAPHMEM_REPEATED_BLOCKS", "1") != "0" and recording.mode in ("inference", "train") \
            and _per_block(recording.parallel):
        stack = find_stack(model)
    step = recording.step
    # checkpointing every k-th block makes k blocks the unit that repeats
    period = step.checkpoint.every if step.checkpoint and recording.mode == "train" else 1
    # blocks chosen one by one (--checkpoint-blocks) repeat by no period: the cut model would
    # checkpoint its own first blocks by those indices, not the whole model's
    chosen = step.checkpoint is not None and bool(step.checkpoint.blocks) and recording.mode == "train"
    if stack is None or chosen or stack.length % period or stack.length <= KEEP * period:
        return trace_step(model, recording, cuda=cuda)
    progress.show(f"recording {KEEP * period} of the {stack.length} alike blocks of {stack.path or 'the model'}")
    why = "the cut recording does not repeat by offset"
    try:
        with cut_to(stack, KEEP * period):
            cut = trace_step(model, recording, cuda=cuda)
        if same_trace(repeat_blocks(cut, stack.path, KEEP * period, period=period, graph=False), cut):
            whole = repeat_blocks(cut, stack.path, stack.length, period=period)
            if cuda is not None:
                _count_placed_calls(cuda, cut, stack, period)
            return whole
    except Exception as exc:  # broad: Unrepeatable, or the cut (user) model failing; the whole recording decides
        why = f"{type(exc).__name__}: {first_line(exc)}"
    if cuda is not None:
        cuda.backends.clear()
        cuda.calls.clear()
    progress.show(f"recording all {stack.length} blocks of {stack.path or 'the model'} ({why})")
    return trace_step(model, recording, cuda=cuda)


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
