"""What every step driver is given, and the marks they all make.

Input: the recording's model, its fake inputs, the recorder and the step configuration.
Output: ``StepRun``, one frozen value a driver reads what it runs from; ``saving``, the pack
hook that notes tensors saved for backward; ``mark_output``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import tree_flatten
from graphmem.job.step import StepConfig
from graphmem.records import Role
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.distributed import RankFork

__all__ = ["StepRun", "mark_output", "saving"]


@dataclass(frozen=True, slots=True)
class StepRun:
    """One recording's step as a driver runs it.

    Attributes:
        mode: ``inference``, ``train``, ``prefill`` or ``decode``.
        model: the module called (a parallel engine's wrapper, or ``inner`` itself).
        inner: the module whose parameters train.
        args, kwargs: the fake inputs.
        recorder: the recorder the ops go to.
        step: how the training step runs.
        device: the device the fake tensors report.
        autocast: enters ``--amp``'s autocast on that device (or nothing).
        zero: ZeRO-1: the optimizer is ZeroRedundancyOptimizer's.
        fork: ZeRO-1's other ranks, forked at the first optimizer step (graphmem.trace.ranks).
    """

    mode: str
    model: nn.Module
    inner: nn.Module
    args: list[Any]
    kwargs: dict[str, Any]
    recorder: Recorder
    step: StepConfig
    device: torch.device
    autocast: Callable[[], AbstractContextManager[Any]]
    zero: bool = False
    fork: RankFork | None = None


def saving(recorder: Recorder) -> Any:
    """The pack hook: note the storage as saved for backward.

    It returns a detached alias, not the tensor itself: a saved output that held itself would
    form a reference cycle (output -> grad_fn -> saved output) that keeps it alive until the
    garbage collector runs, where the real run frees it at once.  The alias shares the
    storage, so memory is unchanged; its detach is not recorded (no real run performs it).
    The alias is watched like any tensor the recorder sees: when it is the storage's last
    holder, its death is what releases the storage.
    """
    def pack(t: torch.Tensor) -> torch.Tensor:
        recorder.mark(t, Role.SAVED)
        with recorder.silenced():
            alias = t.detach()
        recorder.mark(alias, Role.SAVED)
        return alias
    return pack


def mark_output(recorder: Recorder, out: Any) -> None:
    """Every tensor of ``out`` (a model's output, a tuple, a transformers ModelOutput) is an output."""
    leaves = out.to_tuple() if hasattr(out, "to_tuple") else out
    for leaf in tree_flatten(leaves)[0]:
        if isinstance(leaf, torch.Tensor):
            recorder.mark(leaf, Role.OUTPUT)
