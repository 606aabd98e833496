"""The pipeline-parallel driver: one rank's stage run by torch.distributed.pipelining's schedule.

Input: a ``StepRun`` whose model is the rank's stage (graphmem.trace.distributed builds it
and the schedule).  Output: the stage's ops, phased as the schedule runs each microbatch's
forward, loss and backward, then the optimizer step.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import schedule_stage
from graphmem.errors import UnsupportedError, UserInputError
from graphmem.job.option import spelling
from graphmem.job.parallel import ParallelSpec
from graphmem.job.step import StepConfig
from graphmem.records import Phase, Role
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.distributed import pipeline_schedule, pipeline_stage_module, pipeline_warmup_known
from graphmem.trace.step.checkpointing import checkpointed
from graphmem.trace.step.optim import compute_loss
from graphmem.trace.step.run import StepRun, saving
from graphmem.trace.step.training import Loop, mark_gradients, optimizer_step

__all__ = ["Pipeline", "check_pipeline", "run_pipeline"]


def check_pipeline(mode: str, step: StepConfig) -> None:
    """What pp=N records: training, one step per iteration, without autocast.

    Raises:
        UserInputError / UnsupportedError: another mode, gradient accumulation, or autocast.
    """
    if mode != "train":
        raise UserInputError(f"{spelling('parallel')} pp models the training step only, not {spelling('mode')} "
                             f"{mode}; use {spelling('mode')} train")
    if step.grad_accum != 1:
        raise UserInputError(f"{spelling('parallel')} pp: the pipeline's microbatches are its gradient accumulation; "
                             f"use {spelling('microbatches')} instead of {spelling('grad_accum')}")
    if step.amp is not None:
        raise UnsupportedError(f"{spelling('parallel')} pp with {spelling('amp')} is not modelled yet")
    # imported before recording, as a trainer imports it: the import makes a 4-byte module
    # constant (the losses' sum reducer) that is no part of the step
    importlib.import_module("torch.distributed.pipelining")


class Pipeline:
    """One rank's pipeline stage: its module, the example shapes, the schedule's settings."""

    def __init__(self, model: nn.Module, spec: ParallelSpec, rank: int, fake_mode: Any,
                 inputs: tuple[list[Any], dict[str, Any]], step: StepConfig) -> None:
        self.spec, self.rank, self.fake_mode, self.inputs, self.step = spec, rank, fake_mode, inputs, step
        self.stage_module, self.example_in, self.example_out = pipeline_stage_module(
            model, spec, rank, fake_mode, *inputs)
        self.first = rank == 0
        self.last = rank == spec.degree("pp") - 1

    def schedule(self) -> Any:
        kind = self.step.loss

        def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
            return compute_loss(kind, output, target)

        with self.fake_mode:
            return pipeline_schedule(self.stage_module, self.spec, self.rank, self.example_in, self.example_out,
                                     loss_fn)


def run_pipeline(run: StepRun, pipeline: Pipeline) -> int:
    """A pipeline trainer's step on this rank, per iteration: ``schedule.step(*inputs)`` on the
    first stage, ``schedule.step(target=targets, losses=losses)`` on the last, ``schedule.step()``
    in between; then the optimizer step and zero_grad.  The phases follow the schedule: each
    microbatch's forward, loss and backward as the stage runs them.  Returns 0 (no KV cache)."""
    inner, recorder = pipeline.stage_module, run.recorder
    inner.train()
    loop = Loop(run)
    schedule = pipeline.schedule()
    _phase_the_schedule(schedule, pipeline.last, recorder)
    targets: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(saving(recorder), lambda t: t), \
            checkpointed(inner, run.step, recorder), pipeline_warmup_known():
        for iteration in range(run.step.iterations):
            recorder.iteration = iteration
            recorder.phase = Phase.FORWARD
            if pipeline.last and not targets:  # the batch's labels, kept like the data
                out = pipeline.example_out[0]
                shape = (out.shape[0] * pipeline.spec.n_microbatches, *out.shape[1:-1])
                targets.append(torch.zeros(shape, dtype=torch.int64, device=out.device))
                recorder.mark(targets[0], Role.INPUT, "targets")
            losses: list[torch.Tensor] = []
            if pipeline.first:
                extra = {"target": targets[0], "losses": losses} if pipeline.last else {}
                schedule.step(*run.args, **run.kwargs, **extra)
            elif pipeline.last:
                schedule.step(target=targets[0], losses=losses)
            else:
                schedule.step()
            if iteration == 0:
                _mark_receive_buffers(schedule_stage(schedule), recorder)
            mark_gradients(loop)
            optimizer_step(loop)
            del losses
            recorder.poll()
    return 0


def _phase_the_schedule(schedule: Any, last: bool, recorder: Recorder) -> None:
    """The stage's forward, backward and (on the last stage) loss set the recorder's phase."""
    stage = schedule_stage(schedule)
    wrapped = [(stage, "forward_one_chunk", Phase.FORWARD), (stage, "backward_one_chunk", Phase.BACKWARD),
               (stage, "backward_weight_one_chunk", Phase.BACKWARD)]
    if last:  # the schedule asks every stage; only the last computes a loss
        wrapped.append((schedule, "_maybe_compute_loss", Phase.LOSS))
    for owner, name, phase in wrapped:
        if hasattr(owner, name):
            setattr(owner, name, _in_phase(recorder, phase, getattr(owner, name)))


def _mark_receive_buffers(stage: Any, recorder: Recorder) -> None:
    for info in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
        for recv in info:
            if isinstance(getattr(recv, "buffer", None), torch.Tensor):
                recorder.mark(recv.buffer, Role.COMMUNICATION, "pipeline receive buffers")


def _in_phase(recorder: Recorder, phase: Phase, method: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        recorder.phase = phase
        return method(*args, **kwargs)
    return run
