"""Stage 2: trace.  module + a ``Recording`` -> the recorded step as an fx graph with lifetimes.

Input: an nn.Module (on meta, or a user's instance) and a ``Recording``: the input specs, the
mode, the step, the target and what the user declared.  Output: a ``Trace``: the fx graph of
every aten op in real execution order (forward, the autograd engine's backward, the
torch.optim step), each op's phase and module, and each storage's size, creation op and
release op.

How, in four steps (``trace_step``): prepare (the fake mode, the size symbol, a copy of the
model for the engines that change it); declare (fake parameters and inputs as placeholders
with their roles and assumed values); run the step's driver (graphmem.trace.step, chosen by
mode from ``DRIVERS``) under the fake mode, the recorder and the recording's patches; finish
into a ``Trace``.  Training runs ``step.iterations`` iterations: the first creates the
optimizer state lazily, the second runs with that state resident.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import expr_of, quiet_fake_tensor_logs, shape_guards, size_symbol
from graphmem.errors import UserInputError
from graphmem.job.assume import Assumptions
from graphmem.job.devices import cuda_calls_on_cpu
from graphmem.job.parallel import ParallelSpec
from graphmem.job.spec import InputSpec
from graphmem.job.step import StepConfig
from graphmem.records import SymbolicSizes, Trace
from graphmem.trace.core.fake_mode import recording_fake_mode, symbolic_fake_mode
from graphmem.trace.core.fakes import fake_inputs, fake_parameters
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.cuda_target.kernels import CudaKernels
from graphmem.trace.distributed import Applied, RankFork, apply_parallel, fake_process_group, meta_copy
from graphmem.trace.rules import RuleTable, rules_for
from graphmem.trace.step.autocast import autocast_for, cuda_autocast_rules
from graphmem.trace.step.declare import declare_inputs, declare_parameters, declare_targets, parameter_names
from graphmem.trace.step.errors import errors_explained
from graphmem.trace.step.generation import run_generation
from graphmem.trace.step.inference import run_inference
from graphmem.trace.step.patches import fresh_caches, recording_patches, recursion_room
from graphmem.trace.step.pipelined import Pipeline, check_pipeline, run_pipeline
from graphmem.trace.step.run import StepRun
from graphmem.trace.step.training import optimizer_reads, run_training
from graphmem.trace.values.shadows import describe

__all__ = ["DRIVERS", "MODES", "Recording", "trace_step"]

# the step each mode runs; each returns the bytes of the KV cache it leaves (0: none)
DRIVERS: dict[str, Callable[[StepRun], int]] = {"inference": run_inference, "train": run_training,
                                                "prefill": run_generation, "decode": run_generation}
MODES = tuple(DRIVERS)


@dataclass(frozen=True, slots=True)
class Recording:
    """What one recording is, resolved before anything is recorded.

    Attributes:
        inputs: example inputs; unnamed ones are positional, named ones keywords.
        mode: ``"inference"`` (eval, no_grad), ``"train"``, ``"prefill"`` or ``"decode"``.
        step: how the training step runs (optimizer, loss, amp, checkpointing, ...).
        device: the target device the fake tensors report (``cpu`` for the CUDA target:
            see graphmem.trace.cuda_target.kernels).
        dtype: convert floating parameters and buffers, as ``model.to(dtype)`` would.
        rules: per-op rules for the target device (default: ``rules_for(device)``).
        assume: what the user declared about values graphmem does not see.
        parallel: data-parallel or sharded training (graphmem.trace.distributed); the trace is
            then ``rank``'s, with a fake process group of the spec's world size.
        rank: the rank recorded.
        symbol: (letter, value): the inputs' ``symbolic`` dimensions are recorded as one size
            symbol with that value; the trace's ``sizes`` then give its sizes at any value
            where its guards hold (graphmem.trace.symbolic).
        sample: the inputs' real values, by name (``--sample``): read where the model reads values.
    """

    inputs: tuple[InputSpec, ...]
    mode: str = "train"
    step: StepConfig = field(default_factory=StepConfig)
    device: str = "cpu"
    dtype: torch.dtype | None = None
    rules: RuleTable | None = None
    assume: Assumptions = field(default_factory=Assumptions)
    parallel: ParallelSpec | None = None
    rank: int = 0
    symbol: tuple[str, int] | None = None
    sample: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UserInputError(f"unknown mode {self.mode!r}; expected one of: {', '.join(MODES)}")

    @property
    def pipelined(self) -> bool:
        return self.parallel is not None and self.parallel.pipelined


def trace_step(model: nn.Module, recording: Recording, *, cuda: CudaKernels | None = None,
               fork: RankFork | None = None) -> Trace:
    """Record one inference call or ``step.iterations`` training iterations of ``model``.

    Args:
        model: the model; its own tensors are never modified (fakes are swapped in).
        recording: what to record.
        cuda: for the CUDA target, the kernel choices to apply (and to note which attention
            backends ran); the fake tensors then report ``cpu`` and ``recording.device`` is ignored.
        fork: ZeRO-1 (graphmem.trace.ranks): at the first optimizer step, fork a child per
            other rank of ``fork.ranks`` that records the rest of the step as that rank.

    Returns:
        The Trace.

    Raises:
        UserInputError: the model failed on the given inputs.
        TraceError / UnsupportedError: the model cannot be recorded.
    """
    recorder = Recorder(recording.rules or rules_for(recording.device), recording.assume)
    fresh_caches(model)
    if cuda is not None:
        cuda.position = lambda: len(recorder.ops)
    fake_mode = symbolic_fake_mode() if recording.symbol is not None else recording_fake_mode()
    size = size_symbol(fake_mode, *recording.symbol) if recording.symbol is not None else None
    target = torch.device("cpu" if cuda is not None else recording.device)
    given = model  # errors name the user's class, not the one fully_shard makes
    parallel = recording.parallel
    if recording.pipelined:
        check_pipeline(recording.mode, recording.step)
    if parallel is not None and (parallel.shards or parallel.parallelize is not None or recording.pipelined):
        model = meta_copy(model)  # fully_shard (and user code) changes the module's class and parameters
    with recursion_room(), cuda_calls_on_cpu(recording.device, tensors_on=target.type, functions=False), \
            fake_parameters(model, fake_mode, target, recording.dtype) as (names, values), \
            fake_process_group(parallel.world_size, recording.rank) if parallel else contextlib.nullcontext():
        inputs = functools.partial(fake_inputs, recording.inputs, fake_mode, target, size)
        pipeline, applied = _engines(model, recording, fake_mode, inputs)
        inner = applied.inner if applied else model
        with recorder.modules.tracking(inner):
            args, kwargs = pipeline.inputs if pipeline else inputs()
            declare_parameters(recorder, parameter_names(inner) if applied else names,
                               applied.buffers if applied else (), values)
            declare_inputs(recorder, recording.inputs, args, kwargs, recording.assume, recording.sample)
            if recording.mode == "train":
                declare_targets(recorder, inner, args, kwargs, fake_mode, target, recording.assume.boxes)
            run = StepRun(mode=recording.mode, model=applied.model if applied else model, inner=inner,
                          args=args, kwargs=kwargs, recorder=recorder, step=recording.step, device=target,
                          autocast=autocast_for(recording.step, target, cuda is not None),
                          zero=bool(parallel and parallel.degree("zero1") > 1 and not pipeline),
                          fork=None if pipeline else fork)
            with errors_explained(recorder, given), quiet_fake_tensor_logs():
                _read_optimizer_values(run, recording)
                with fake_mode, recorder, cuda or contextlib.nullcontext(), recording_patches(recorder), \
                        cuda_autocast_rules(cuda is not None, recording.step):
                    kv_bytes = run_pipeline(run, pipeline) if pipeline else DRIVERS[recording.mode](run)
                recorder.poll(everything=True)
                recorder.books.release_replaced(inner)
    return _finish(recorder, recording, fake_mode, size, kv_bytes)


def _engines(model: nn.Module, recording: Recording, fake_mode: Any,
             inputs: Callable[[], tuple[list[Any], dict[str, Any]]]) -> tuple[Pipeline | None, Applied | None]:
    """The rank's pipeline stage (made with the fake ``inputs()``), or the model as the parallel
    engines make it (None: as it is)."""
    parallel = recording.parallel
    if parallel is not None and recording.pipelined:
        pipeline = Pipeline(model, parallel, recording.rank, fake_mode, inputs(), recording.step)
        return pipeline, Applied(model=pipeline.stage_module, inner=pipeline.stage_module, buffers=[])
    return None, apply_parallel(model, parallel, fake_mode) if parallel else None


def _read_optimizer_values(run: StepRun, recording: Recording) -> None:
    """Values the optimizer reads with .item(), from a real one-element replica (outside the
    modes), for this rank and each rank ``run.fork`` will record."""
    if recording.mode != "train":
        return
    reads = optimizer_reads(run.inner, recording.step, run.device, recording.parallel, recording.rank)
    run.recorder.answers.use_replica(reads)
    if reads:
        run.recorder.assumptions.append(
            "optimizer step: the values its code reads (step counts and the like) come from a real run "
            "of the same optimizer on tiny parameters with finite gradients")
    if run.fork is not None:
        run.fork.reads = {r: optimizer_reads(run.inner, recording.step, run.device, recording.parallel, r)
                          for r in run.fork.ranks}


def _finish(recorder: Recorder, recording: Recording, fake_mode: Any, size: torch.SymInt | None,
            kv_bytes: int) -> Trace:
    """The Trace: the recorder's books, frozen, with the notes and (where sizes were a symbol
    and no answer read a value) the sizes as formulas."""
    answers = recorder.answers
    notes = (answers.unseen_note() + recorder.assumptions + answers.declared_notes()
             + describe(answers.shadows.used, recording.assume.inputs))
    sizes = None
    if size is not None and not answers.shadows.used and not answers.bounded:  # else: values at the hint
        assert recording.symbol is not None, "trace_step: a size symbol was made from recording.symbol"
        sizes = SymbolicSizes(name=recording.symbol[0], symbol=expr_of(size), hint=recording.symbol[1],
                              storages={s.sid: s.sizes for s in recorder.books.storages if s.sizes is not None},
                              ops=dict(recorder.op_sizes), guards=shape_guards(fake_mode))
    return Trace(mode=recording.mode, fx=recorder.fx.graph, ops=tuple(recorder.ops), storages=recorder.freeze(),
                 optimizer=recording.step.optimizer if recording.mode == "train" else None,
                 assumptions=tuple(notes), kv_cache_bytes=kv_bytes, sizes=sizes,
                 unseen_inputs=tuple(sorted(answers.unseen)), loss=recorder.loss)
