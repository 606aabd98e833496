"""analyze(): the stages in order — job, load, trace, liveness, memory model — nothing else;
analyze_curve(): the same with the size symbol recorded once for every value; run_program():
a program's ranks recorded as it runs, each analysed the same way (graphmem.memory.analyse)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from graphmem._torch_api import OP_ERRORS, OpOverload
from graphmem.api.modes import Built, build, report_modes
from graphmem.errors import GraphmemError, UserInputError
from graphmem.job.job import DEFAULT_GPU, Job, edited, make_job
from graphmem.job.load import ModelSource
from graphmem.job.option import fold, spelling
from graphmem.job.program import Program, make_program, program_ranks
from graphmem.job.sections import Target
from graphmem.job.spec import InputSpec, input_symbol, parse_input_spec, spec_at, substitute, validate_inputs
from graphmem.memory.analyse import CudaSetup, allocator_again, analyse, highest_first
from graphmem.memory.liveness import POLICIES
from graphmem.memory.results import MemoryReport, ModeReport, RankReport
from graphmem.process import progress
from graphmem.records import Trace
from graphmem.trace import CudaKernels, Recording, record_step, trace_at
from graphmem.trace.program import GpuMemory, GpuTarget, Launched, ProgramTrace, record_program
from graphmem.trace.rules import Rule, rules_for

__all__ = ["PeakCurve", "analyze", "analyze_curve", "run_program"]


def analyze(job: Job | str | ModelSource | None = None,
            inputs: Sequence[InputSpec | str | torch.Tensor] | InputSpec | str | torch.Tensor = (),
            *, rules: Mapping[OpOverload, Rule] | None = None, policy: str = "observed",
            checkpoint_comparison: bool = True, **keywords: Any) -> MemoryReport:
    """Predict the memory of one inference call and of a training step, without running them.

    Args:
        job: a ``graphmem.Job``, or the model (``"pkg.module:Attr"`` / ``"file.py:Attr"``, an
            nn.Module class, a factory returning one, or an nn.Module instance, left
            untouched); None with ``preset=``.
        inputs: example inputs as ``InputSpec``, ``"[NAME=]DIMS[:DTYPE]"`` strings, or example
            tensors (only their shape and dtype are used: a meta tensor will do).
        rules: extra per-op scratch rules, overriding the registry's for the device.
        policy: storage release policy, ``"observed"`` or ``"last_use"`` (see
            graphmem.memory.liveness).
        checkpoint_comparison: with ``checkpoint``, also analyse the step without it
            (``MemoryReport.train_without_checkpoint``); False leaves that out.
        **keywords: the job's other settings, each the keyword of one option of ``graphmem
            analyze`` (``--optimizer-impl fused`` is ``optimizer_impl="fused"``; the sections
            and their fields: docs/configuration.md).  With a Job, keywords change it.

    Returns:
        A MemoryReport; ``inference`` / ``train`` are None when not asked for.  Sizes in bytes.

    Known limitations: docs/how-it-works.md (kernels' internal workspaces without a rule;
    values computed from weights are never known).
    """
    job = _resolved(job, inputs, keywords, policy)
    if input_symbol(job.inputs.specs) is not None:
        validate_inputs(job.inputs.specs, symbolic=False)
    built = build(job, rules)
    return report_modes(job, built, policy, record_step, [parse_input_spec(text) for text in job.inputs.specs],
                        fork_ranks=True, checkpoint_comparison=checkpoint_comparison)


@dataclass(frozen=True, slots=True)
class PeakCurve:
    """One recording of a job for every value of its size symbol (``B`` in ``Bx1000``).

    ``at(value)`` is the MemoryReport ``analyze`` gives at that value, with no new recording,
    wherever ``holds(value)``: the recording's guards hold there (graphmem.trace.symbolic).
    ``exact`` is False where the recording kept no size formula (it read input values or
    bounded a value-dependent size): it then holds at ``hint`` only."""

    job: Job
    symbol: str
    hint: int
    traces: tuple[Trace, ...]
    policy: str
    built: Built

    @property
    def exact(self) -> bool:
        return all(t.sizes is not None for t in self.traces)

    def holds(self, value: int) -> bool:
        """Whether ``at(value)`` equals recording at ``value``."""
        return value == self.hint or all(t.sizes is not None and t.sizes.holds(value) for t in self.traces)

    def at(self, value: int) -> MemoryReport:
        """The report at ``value`` (sizes in bytes).

        Raises:
            ValueError: the recording does not hold at ``value``.
        """
        if not self.holds(value):
            raise ValueError(f"PeakCurve.at: {self.symbol}={value} is outside what the recording at "
                             f"{self.symbol}={self.hint} holds for")
        traces = iter(self.traces)

        def replay(*args: Any, **kwargs: Any) -> Trace:  # the recordings, in the order report_modes asks for them
            trace = next(traces)
            return trace if value == self.hint else trace_at(trace, value)
        job = self.job.with_inputs(tuple(substitute(t, self.symbol, value) for t in self.job.inputs.specs))
        specs = [spec_at(t, self.symbol, value) for t in self.job.inputs.specs]
        return report_modes(job, self.built, self.policy, replay, specs)


def analyze_curve(job: Job | str | ModelSource | None = None,
                  inputs: Sequence[InputSpec | str | torch.Tensor] | InputSpec | str | torch.Tensor = (),
                  *, hint: int = 2, rules: Mapping[OpOverload, Rule] | None = None,
                  policy: str = "observed", **keywords: Any) -> PeakCurve:
    """Record the job once with its size symbol (one capital letter among the inputs'
    dimensions: ``Bx1000``, ``input_ids=1xS:int64``) at ``hint``; see PeakCurve.

    Takes what ``analyze`` takes.  Jobs with ``generate`` or ``parallel`` are recorded at
    ``hint`` alone (the curve then holds at ``hint`` only).

    Raises:
        UserInputError: no size symbol among the inputs, or a hint below 2.
    """
    job = _resolved(job, inputs, keywords, policy)
    symbol = validate_inputs(job.inputs.specs, symbolic=True)
    assert symbol is not None, "analyze_curve: validate_inputs returned no symbol"
    if hint < 2:
        raise UserInputError(f"a curve is recorded at {symbol} >= 2 (sizes 0 and 1 are special cases); got {hint}")
    built = build(job, rules)
    recorded: list[Trace] = []
    formula = job.generate is None and job.parallel is None

    def record(model: torch.nn.Module, recording: Recording, *, cuda: CudaKernels | None = None) -> Trace:
        trace = None
        if formula:
            try:
                trace = record_step(model, replace(recording, symbol=(symbol, hint)), cuda=cuda)
            except (GraphmemError, *OP_ERRORS):  # a kernel, rule or model needs numbers: recorded with them below
                trace = None
        recorded.append(trace if trace is not None else record_step(model, recording, cuda=cuda))
        return recorded[-1]

    at_hint = job.with_inputs(tuple(substitute(t, symbol, hint) for t in job.inputs.specs))
    report_modes(at_hint, built, policy, record, [spec_at(t, symbol, hint) for t in job.inputs.specs])
    return PeakCurve(job=job, symbol=symbol, hint=hint, traces=tuple(recorded), policy=policy, built=built)


def _resolved(job: Job | str | ModelSource | None, inputs: Any, keywords: dict[str, Any], policy: str) -> Job:
    """The Job analyze() was given or described, with its preset applied; checked."""
    if not isinstance(job, Job):
        job = make_job(keywords.pop("model", job), keywords.pop("inputs", inputs), **keywords)
    elif inputs or keywords:
        job = edited(job, **({"inputs": inputs} if inputs else {}), **keywords)
    if policy not in POLICIES:
        raise UserInputError(f"unknown policy {policy!r}; expected one of: {', '.join(POLICIES)}")
    job = job.with_preset()
    if not job.inputs.specs and job.generate is None:
        raise UserInputError(f"no input given; pass at least one {spelling('inputs')} such as 32x1000")
    if job.model.target is None:
        raise UserInputError(f"no model given: pass TARGET (pkg.module:Attr) or {spelling('preset')} NAME")
    return job


def run_program(program: Program | str, argv: Sequence[str] = (), *, steps: int = 2, module: bool = False,
                device: str = "cpu", gpu: str | None = None, alloc_conf: str | None = None, sdpa: str = "auto",
                nproc_per_node: int | None = None, nnodes: int | None = None, ranks: str | Sequence[int] = "auto",
                policy: str = "observed", write_through: Sequence[str] = ()) -> MemoryReport:
    """Predict the memory of a training program as it runs: ``python SCRIPT ARGV`` (or ``-m``
    MODULE) from its first line to the end of its ``steps``-th optimizer step, every tensor a fake.

    Args:
        program: a ``Program``, or the script's path (the module's name with ``module``).
        argv, steps: the program's own arguments; optimizer steps to record.
        device, gpu, alloc_conf, sdpa: the target, as ``analyze`` takes it (``gpu`` implies cuda:
            the program's "cuda" is that GPU, its memory what the caching allocator reserves).
        nproc_per_node, nnodes: processes, as ``torchrun`` starts them (with a string ``program``).
        ranks: which to record: ``auto`` (rank 0, the last, each pipeline stage's first), ``all``
            or a list; ``policy``: the storage release policy (graphmem.memory.liveness).
        write_through: paths the program writes for real (the others go to a layer of its own).

    Returns:
        A MemoryReport whose ``train`` is the whole run (``iteration_peaks`` per step); with
        several processes the rank with the highest peak, each recorded rank in ``ranks``.

    Raises:
        UserInputError: no such script, ``steps`` < 1, a rank outside the world, an unknown GPU.
        TraceError: the program raised, or ended before its first optimizer step.
    """
    device = "cuda" if gpu is not None else device
    target = fold(Target, {"device": device, "gpu": gpu, "sdpa": sdpa, "alloc_conf": alloc_conf})  # checked there
    if isinstance(program, str):
        program = make_program(program, tuple(argv), module=module, steps=steps, nproc_per_node=nproc_per_node,
                               nnodes=nnodes, write_through=tuple(write_through), ranks=ranks, runs_on=target)
    else:  # what is given replaces the Program's own
        given = (device, gpu, alloc_conf, sdpa) != ("cpu", None, None, "auto")
        program = replace(program, runs_on=target if given else program.runs_on,
                          ranks=program.ranks if ranks == "auto" else program_ranks(ranks, program.world_size))
    where, modeled = program.runs_on, frozenset(str(op) for op in rules_for(program.runs_on.device).scratch)
    cuda = CudaSetup.of(where.gpu or DEFAULT_GPU, where.alloc_conf) if where.device == "cuda" else None
    memory = partial(_gpu_memory, cuda=cuda, policy=policy, modeled=modeled)
    launched = record_program(program, partial(_gpu_target, cuda, where.sdpa, memory) if cuda is not None else None)
    reports = {rank: _rank_report(traced, policy, modeled, cuda) for rank, traced in launched.traces.items()}
    return _program_report(program, where.device, cuda, launched, reports)


def _gpu_target(cuda: CudaSetup, sdpa: str, memory: Callable[[Trace, int], GpuMemory]) -> GpuTarget:
    """A program's "cuda" as the target GPU (``memory``: its counters), its attention kernels counted anew."""
    gpu = cuda.gpu
    return GpuTarget(gpu.product, gpu.total_memory_bytes, gpu.compute_capability, CudaKernels(gpu, sdpa), memory)


def _gpu_memory(trace: Trace, since: int, *, cuda: CudaSetup | None, policy: str, modeled: frozenset[str]
                ) -> GpuMemory:
    """What the program's ``torch.cuda`` memory counters say after the run so far (``trace``),
    peaks counted from op ``since`` on."""
    if not trace.ops:  # asked before the program ran an op: nothing allocated yet
        return GpuMemory(0, 0, 0, 0)
    stats = analyse(trace, policy=policy, modeled=modeled, cuda=cuda).allocator
    assert stats is not None, "_gpu_memory: a report on a GPU has the allocator's view"
    allocated, reserved = stats.peaks_from(since)
    return GpuMemory(stats.allocated_end_bytes, stats.reserved_end_bytes, allocated, reserved)


def _rank_report(traced: ProgramTrace, policy: str, modeled: frozenset[str], cuda: CudaSetup | None) -> ModeReport:
    """One recorded rank of a program, analysed as analyze analyses a mode."""
    progress.show(f"analysing {len(traced.trace.ops):,} ops")
    return analyse(traced.trace, policy=policy, modeled=modeled, cuda=cuda, communicators=traced.communicators,
                   sdpa_backends=traced.sdpa_backends)


def _program_report(program: Program, device: str, cuda: CudaSetup | None, launched: Launched,
                    reports: dict[int, ModeReport]) -> MemoryReport:
    """The program's report: its training is the recorded rank's with the highest peak, holding
    every recorded rank's; its first rank's model, files and failure."""
    recorded = sorted(launched.traces.items())
    first = recorded[0][1]
    train = reports[recorded[0][0]]
    if program.world_size > 1:
        why = [*(["rank 0 and the last"] if program.ranks is None else []), *launched.added]
        note = (f"ranks {', '.join(str(rank) for rank, _ in recorded)} of {program.world_size} recorded"
                + (f" ({'; '.join(why)}; --ranks all records every rank)" if why else ""))
        train = highest_first((RankReport(rank, (rank,), reports[rank]) for rank, _ in recorded), note)
    failed = [(rank, traced.failed) for rank, traced in recorded if traced.failed]
    failure = None
    if failed:
        failure = failed[0][1] + (f" (rank {failed[0][0]})" if program.world_size > 1 else "")
    return MemoryReport(target=first.models[0] if first.models else program.target, device=device, inputs=(),
                        inference=None, train=train, program=program.command, gpu=cuda.gpu if cuda else None,
                        parallel=f"{program.world_size} processes" if program.world_size > 1 else None,
                        program_failed=failure, program_files=first.wrote)


def program_allocator_again(report: MemoryReport, alloc_conf: str | None) -> MemoryReport:
    """``run_program``'s report on a GPU with the caching allocator modelled again under
    ``alloc_conf`` (None: the environment's): the recordings stand, the program does not run
    again (a verdict's what-if of expandable segments).  The rank shown first is again the one
    with the highest peak."""
    assert report.gpu is not None and report.train is not None, "program_allocator_again: a program's report on a GPU"
    return allocator_again(report, CudaSetup.of(report.gpu.name, alloc_conf))
