"""A ZeRO-1 step recorded once for several ranks, forked at the first optimizer step.

Input: what graphmem.trace.recording.trace_step takes (a model and a ``Recording``), and the
ranks.  Output: each rank's ``Trace`` (graphmem.trace.distributed.rank_fork runs the forked ranks).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from graphmem.job.parallel import ParallelSpec
from graphmem.process.workers import processes
from graphmem.records import Trace
from graphmem.trace.cuda_target.kernels import CudaKernels
from graphmem.trace.distributed import RankFork
from graphmem.trace.recording import Recording, trace_step

__all__ = ["forks_ranks", "record_ranks"]


def forks_ranks(parallel: ParallelSpec | None, ranks: Sequence[int]) -> bool:
    """Whether record_ranks records these ranks from one shared beginning: ZeRO-1 alone (DDP's
    ranks are alike; FSDP2, TP and PP ranks differ from the first op).  ``GRAPHMEM_FORK_RANKS=0``:
    never (each rank recorded on its own).  Never in a CUDA build of torch either: there a
    process forked after the recorded backward cannot run autograd again ("Unable to handle
    autograd's threading in combination with fork-based multiprocessing", seen with torch
    2.14.1's CUDA build on a machine with no GPU), so each rank is recorded on its own."""
    return (parallel is not None and len(ranks) > 1 and {name for name, _ in parallel.degrees} == {"zero1"}
            and parallel.parallelize is None and hasattr(os, "fork") and torch.version.cuda is None
            and os.environ.get("GRAPHMEM_FORK_RANKS", "1") != "0")


def record_ranks(model: nn.Module, recording: Recording, ranks: Sequence[int], *, cuda: CudaKernels | None = None
                 ) -> list[tuple[Trace, dict[str, int] | None]]:
    """trace_step's Trace for each of ``ranks`` of a ZeRO-1 step (forks_ranks), with the attention
    kernels each chose on the CUDA target (``cuda``: counted anew for each).  The ranks share
    their recording up to the first optimizer step (graphmem.trace.distributed.rank_fork); the other ranks'
    traces come back without their fx graph."""
    fork = RankFork(ranks[1:], at_once=processes())
    try:
        trace = trace_step(model, replace(recording, mode="train", rank=ranks[0]), cuda=cuda, fork=fork)
    except BaseException as exc:  # any failure, an interrupt too: sent to the parent (a child) and re-raised
        if fork.rank is not None:
            fork.send(exc)  # a child ends here
        fork.stop()
        raise
    backends = dict(cuda.backends) if cuda else None
    if fork.rank is not None:
        fork.send((replace(trace, fx=torch.fx.Graph()), backends))
    others = fork.gather()
    return [(trace, backends), *(others[r] for r in ranks[1:])]
