"""``--amp``: torch.autocast on the target device, as a trainer enters it around forward and loss."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from graphmem.job.step import AMP_DTYPES, StepConfig
from graphmem.trace.cuda_target.autocast import cuda_autocast, cuda_autocast_lists

__all__ = ["autocast_for", "cuda_autocast_rules"]


def autocast_for(step: StepConfig, device: torch.device, cuda: bool) -> Callable[[], AbstractContextManager[Any]]:
    """What enters torch.autocast for ``--amp`` on the (fake) device, or nothing.  The CUDA
    target records on fake CPU tensors, so there autocast runs with CUDA's op lists
    (graphmem.trace.cuda_target.autocast)."""
    def enter() -> AbstractContextManager[Any]:
        if step.amp is None:
            return contextlib.nullcontext()
        if cuda:
            return cuda_autocast(AMP_DTYPES[step.amp])
        return torch.autocast(device.type, dtype=AMP_DTYPES[step.amp])
    return enter


@contextlib.contextmanager
def cuda_autocast_rules(active: bool, step: StepConfig) -> Iterator[None]:
    """For the CUDA target with --amp: CUDA's autocast lists for the whole step (checkpoint's
    recompute in backward re-enters autocast on its own, and must get CUDA's lists too)."""
    if not active or step.amp is None:
        yield
        return
    with cuda_autocast_lists():
        yield
