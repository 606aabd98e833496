"""analyze(): the stages in order — job, load, trace, liveness, memory model — nothing else;
analyze_curve(): the same with the size symbol recorded once for every value."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from graphmem import interrupts, progress
from graphmem._torch_api import OP_ERRORS, OpOverload
from graphmem.cuda.alloc_conf import AllocatorConfig, alloc_conf_from_environment, parse_alloc_conf
from graphmem.cuda.gpus import GPU, get_gpu
from graphmem.cuda.nccl import nccl_buffer_bytes
from graphmem.errors import GraphmemError, TraceError, UserInputError
from graphmem.job.assume import Assumptions
from graphmem.job.finetune import count_trained, prepare_finetuning
from graphmem.job.job import DEFAULT_GPU, Job, make_job
from graphmem.job.load import ModelSource, construct_model, resolve_target
from graphmem.job.program import Program, make_program
from graphmem.job.spec import (
    GenerateSpec,
    InputSpec,
    input_symbol,
    parse_input_spec,
    spec_at,
    substitute,
    validate_inputs,
)
from graphmem.job.step import StepConfig, resolve_optimizer
from graphmem.memory.cuda_replay import model_cuda_allocator
from graphmem.memory.liveness import POLICIES, compute_lifetimes
from graphmem.memory.mode_report import build_mode_report
from graphmem.memory.results import GenerateReport, MemoryReport, ModeReport, RankReport, with_graph
from graphmem.records import FileChange, Phase, Trace
from graphmem.trace import (
    CudaKernels,
    Exchanged,
    GpuMemory,
    GpuTarget,
    Mailbox,
    Recording,
    Waits,
    distinct_ranks,
    forks_ranks,
    record_ranks,
    record_step,
    trace_at,
    trace_program,
)
from graphmem.trace.rules import Rule, RuleTable, rules_for
from graphmem.workers import fork_each, fork_map, forked_autograd_works, processes

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
        **keywords: the job's other settings, as ``graphmem.make_job`` takes them: ``mode``
            (both, train, inference), ``optimizer`` (every torch.optim optimizer by name,
            bitsandbytes 8-bit ones by formula, ``none``, or ``pkg.module:Class``),
            ``optimizer_kwargs``, ``optimizer_impl`` (auto, for-loop, foreach, fused), ``loss``
            (auto, sum, mean, cross_entropy, nll), ``amp`` (bf16, fp16: torch.autocast, fp16
            with a GradScaler), ``checkpoint`` (module classes run under non-reentrant
            activation checkpointing; the report then also holds the peak without it),
            ``grad_accum``, ``dtype`` (``model.to(dtype)``), ``kwargs`` (for the model class or
            factory), ``device`` (cpu: bytes as PyTorch's CPU execution allocates them; cuda:
            CUDA's kernel choices and the caching allocator's allocated and reserved peaks,
            ``ModeReport.allocator``), ``gpu``, ``sdpa``, ``alloc_conf``, ``hf_config``,
            ``preset``, ``generate`` (``"P+N"`` with ``batch``: inference with a KV cache),
            ``assume`` (input name -> ones, zeros, arange or an integer, for reads of
            input-derived values), ``freeze`` (globs on parameter names that do not train) or
            ``lora`` (``"r=16,alpha=32,target=q_proj,v_proj"``: peft's LoRA adapters train, the
            rest is frozen).  With a Job, keywords change it (``Job.updated``).

    Returns:
        A MemoryReport; ``inference`` / ``train`` are None when not asked for.  Sizes in bytes.

    Known limitations:
        Memory a kernel allocates internally without dispatching an op (workspaces) is not
        seen unless a rule in ``graphmem.trace.rules`` models it (cuDNN's RNN reserve space on
        the CUDA target is not).  Values are never known: reads of input-derived values are
        answered from ``assume``; reads of anything computed from weights raise TraceError.
        The CUDA target is modelled from PyTorch's source, not yet measured on a GPU.
    """
    job = _resolved(job, inputs, keywords, policy)
    if input_symbol(job.inputs) is not None:
        validate_inputs(job.inputs, symbolic=False)
    built = _build(job, rules)
    return _report(job, built, policy, record_step, [parse_input_spec(text) for text in job.inputs], fork_ranks=True,
                   checkpoint_comparison=checkpoint_comparison)


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
    built: _Built

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

        def replay(*args: Any, **kwargs: Any) -> Trace:  # the recordings, in the order _report asks for them
            trace = next(traces)
            return trace if value == self.hint else trace_at(trace, value)
        job = replace(self.job, inputs=tuple(substitute(t, self.symbol, value) for t in self.job.inputs))
        return _report(job, self.built, self.policy, replay, [spec_at(t, self.symbol, value) for t in self.job.inputs])


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
    symbol = validate_inputs(job.inputs, symbolic=True)
    assert symbol is not None, "analyze_curve: validate_inputs returned no symbol"
    if hint < 2:
        raise UserInputError(f"a curve is recorded at {symbol} >= 2 (sizes 0 and 1 are special cases); got {hint}")
    built = _build(job, rules)
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

    at_hint = replace(job, inputs=tuple(substitute(t, symbol, hint) for t in job.inputs))
    _report(at_hint, built, policy, record, [spec_at(t, symbol, hint) for t in job.inputs])
    return PeakCurve(job=job, symbol=symbol, hint=hint, traces=tuple(recorded), policy=policy, built=built)


def _resolved(job: Job | str | ModelSource | None, inputs: Any, keywords: dict[str, Any], policy: str) -> Job:
    """The Job analyze() was given or described, with its preset applied; checked."""
    if not isinstance(job, Job):
        job = make_job(keywords.pop("model", job), keywords.pop("inputs", inputs), **keywords)
    elif inputs or keywords:
        job = job.updated(**({"inputs": inputs} if inputs else {}), **keywords)
    if policy not in POLICIES:
        raise UserInputError(f"unknown policy {policy!r}; expected one of: {', '.join(POLICIES)}")
    job = job.with_preset()
    if not job.inputs and job.generate is None:
        raise UserInputError("no input given; pass at least one --input such as 32x1000")
    if job.model is None:
        raise UserInputError("no model given: pass TARGET (pkg.module:Attr) or --preset NAME")
    return job


@dataclass(frozen=True, slots=True)
class _Built:
    """What every recording of a job shares: the built model and the target's rules."""

    module: torch.nn.Module
    dtype: torch.dtype | None
    step: StepConfig
    cuda: tuple[GPU, AllocatorConfig] | None
    table: RuleTable
    assume: Assumptions
    modeled: frozenset[str]
    notes: tuple[str, ...]


def _build(job: Job, rules: Mapping[OpOverload, Rule] | None) -> _Built:
    """Build the model (on the meta device), apply fine-tuning, resolve the target."""
    step, cuda = job.step, _cuda_target(job)
    if cuda is not None:
        step = replace(step, optimizer_impl=_cuda_default_impl(step))
    assert job.model is not None, "_build: a resolved job has a model"
    source = resolve_target(job.model) if isinstance(job.model, str) else job.model
    progress.show(f"building {job.target_name}")
    built = construct_model(source, job.model_kwargs, job.hf_config, device=job.device)
    module = prepare_finetuning(built.module, job.freeze, job.lora, dtype=job.dtype,
                                owned=not isinstance(source, torch.nn.Module), quantize=job.quantize_base)
    dtype = None if job.lora is not None else job.dtype  # LoRA: converted before peft, as trainers do
    interrupts.check()
    table = rules_for(job.device, rules)
    return _Built(module=module, dtype=dtype, step=step, cuda=cuda, table=table, assume=Assumptions.of(job.assume),
                  modeled=frozenset(str(op) for op in table.scratch),
                  notes=(built.note,) if built.note else ())  # how it was built, when not on the meta device


def _report(job: Job, built: _Built, policy: str, trace_of: Callable[..., Trace],
            specs: list[InputSpec], *, fork_ranks: bool = False, checkpoint_comparison: bool = True) -> MemoryReport:
    """Record (``trace_of``, with graphmem.trace.repeat.record_step's arguments) each mode the job asks
    for, then the liveness pass and the memory model on each trace.  ``fork_ranks``: the distinct ranks of a
    parallel job are recorded side by side: ZeRO-1's from one shared beginning
    (graphmem.trace.ranks.record_ranks), others in worker processes (graphmem.workers) when
    there are cores for them;
    ``checkpoint_comparison``: a checkpointed step is also analysed without checkpointing."""
    module, step, cuda, dtype = built.module, built.step, built.cuda, built.dtype

    def recording(m: str, config: StepConfig, inputs: Sequence[InputSpec] | None, rank: int = 0) -> Recording:
        return Recording(inputs=tuple(inputs or specs), mode=m, step=config, device=job.device, dtype=dtype,
                         rules=built.table, assume=built.assume, parallel=job.parallel, rank=rank,
                         sample=job.sample.by_name if job.sample else {})

    def record(m: str, config: StepConfig, inputs: Sequence[InputSpec] | None, rank: int,
               kernels: CudaKernels | None) -> Trace:
        return trace_of(module, recording(m, config, inputs, rank), cuda=kernels)

    def one(m: str, config: StepConfig, inputs: Sequence[InputSpec] | None, rank: int) -> ModeReport:
        kernels = CudaKernels(cuda[0], job.sdpa) if cuda else None
        what = {"train": "the training step", "inference": "inference"}.get(m, m)
        progress.show(f"recording {what}" + (f" on rank {rank}" if job.parallel is not None else ""))
        trace = record(m, config, inputs, rank, kernels)
        return analysed(trace, dict(kernels.backends) if kernels else None)

    def analysed(trace: Trace, backends: dict[str, int] | None) -> ModeReport:
        interrupts.check()
        progress.show(f"analysing {len(trace.ops):,} ops")
        report = build_mode_report(trace, compute_lifetimes(trace, policy), set(built.modeled))
        interrupts.check()
        report = replace(report, assumptions=(*report.assumptions, *built.notes))
        if cuda is None or backends is None:  # (kernels exist exactly when cuda does)
            return report
        return replace(report, allocator=model_cuda_allocator(report, *cuda, parallel=job.parallel),
                       sdpa_backends=backends)

    def graph(m: str, config: StepConfig, inputs: Sequence[InputSpec] | None, rank: int) -> torch.fx.Graph:
        """A rank's fx graph, recorded again here (it was recorded in another process)."""
        return record(m, config, inputs, rank, CudaKernels(cuda[0], job.sdpa) if cuda else None).graph

    def rank_reports(m: str, config: StepConfig, inputs: Sequence[InputSpec] | None,
                     ranks: list[int]) -> list[ModeReport]:
        if fork_ranks and m == "train" and forks_ranks(job.parallel, ranks):  # ZeRO-1: the ranks share their beginning
            progress.show(f"recording the training step on ranks {', '.join(map(str, ranks))}")
            made = record_ranks(module, recording(m, config, inputs), ranks,
                                cuda=CudaKernels(cuda[0], job.sdpa) if cuda else None)
            reports = [analysed(trace, backends) for trace, backends in made]
            here = 1  # the first rank was recorded in this process: its graph is here
        elif fork_ranks and len(ranks) > 1 and processes() > 1 and forked_autograd_works():  # each in a worker
            reports = fork_map(lambda r: with_graph(one(m, config, inputs, r), torch.fx.Graph()), ranks,
                               what="recording a rank")
            here = 0
        else:
            return [one(m, config, inputs, rank) for rank in ranks]
        return reports[:here] + [with_graph(report, partial(graph, m, config, inputs, rank))
                                 for report, rank in zip(reports[here:], ranks[here:], strict=True)]

    def run(m: str, config: StepConfig, inputs: Sequence[InputSpec] | None = None) -> ModeReport:
        if job.parallel is None:
            return one(m, config, inputs, 0)
        distinct = distinct_ranks(module, job.parallel)
        reports = rank_reports(m, config, inputs, [rank for rank, _ in distinct])
        ranks = [RankReport(rank, alike, report) for report, (rank, alike) in zip(reports, distinct, strict=True)]
        ranks.sort(key=lambda r: (-r.report.budget_peak_bytes, r.rank))
        return replace(ranks[0].report, ranks=tuple(ranks))

    gpu = cuda[0] if cuda else None
    if job.generate is not None:
        gen = job.generate
        return MemoryReport(target=job.target_name, device=job.device,
                            inputs=(f"generate {gen.prompt}+{gen.new} x {gen.batch}",),
                            inference=None, train=None, gpu=gpu,
                            generate=_generation(gen, lambda m, s: run(m, step, s)))
    inference = run("inference", step) if job.mode in ("inference", "both") else None
    labelled = _labels_from_ids(module, specs, step)
    train = run("train", step, labelled) if job.mode in ("train", "both") else None
    baseline = (run("train", replace(step, checkpoint=()), labelled)
                if train and step.checkpoint and checkpoint_comparison else None)
    if labelled and train is not None:
        note = ("training: no labels were given, so the input ids are used as labels (a copy, as causal "
                "language-model trainers pass them); give labels=... or --loss to change it")
        train = replace(train, assumptions=(*train.assumptions, note))
    return MemoryReport(target=job.target_name, device=job.device, inputs=tuple(str(s) for s in specs),
                        inference=inference, train=train, train_without_checkpoint=baseline, gpu=gpu,
                        parallel=job.parallel.text if job.parallel else None,
                        loss=step.loss if train is not None else None,
                        trained=count_trained(module, _finetune_text(job)) if train is not None else None)


def run_program(program: Program | str, argv: Sequence[str] = (), *, steps: int = 2, module: bool = False,
                device: str = "cpu", gpu: str | None = None, alloc_conf: str | None = None, sdpa: str = "auto",
                nproc_per_node: int | None = None, nnodes: int | None = None, ranks: str | Sequence[int] = "auto",
                policy: str = "observed", write_through: Sequence[str] = ()) -> MemoryReport:
    """Predict the memory of a training program as it runs: ``python SCRIPT ARGV`` (or ``-m``
    MODULE) recorded from its first line to the end of its ``steps``-th optimizer step, every
    tensor it makes a fake one (graphmem.trace.program).

    Args:
        program: a ``Program``, or the script's path (the module's name with ``module``).
        argv: the program's own arguments.
        steps: optimizer steps to record (any torch.optim optimizer's ``step``).
        device: ``cpu``: bytes as PyTorch's CPU execution allocates them; ``cuda``: the
            program's "cuda" is the GPU ``gpu`` (a preset; default as for analyze), its
            memory what the caching allocator reserves.
        gpu: the GPU preset; implies ``device="cuda"``.
        alloc_conf: PYTORCH_CUDA_ALLOC_CONF settings (default: the environment variable).
        sdpa: the attention backend on the GPU (``auto``: PyTorch's choice).
        nproc_per_node, nnodes: processes per node and nodes, as ``torchrun --nproc-per-node
            --nnodes`` starts them, one process included (with a string ``program``; a ``Program``
            carries its own); neither given: one process, as ``python`` starts it.
        ranks: which to record: ``auto`` (rank 0, the last, and the first rank of each
            pipeline stage), ``all``, or a list (and any rank whose pipeline stage another
            recorded rank waits for: graphmem.trace.program.stage_messages).
        policy: storage release policy (graphmem.memory.liveness).
        write_through: paths the program writes for real (with a string ``program``); every
            other write goes to a layer of its own, dropped after the run.

    Returns:
        A MemoryReport whose ``train`` is the whole run: ``iteration_peaks`` per optimizer step;
        with several processes the rank with the highest peak, each recorded rank in ``ranks``.

    Raises:
        UserInputError: no such script, ``steps`` < 1, an unknown GPU.
        TraceError: the program raised, or ended before its first optimizer step.
    """
    device = "cuda" if gpu is not None else device
    if device not in ("cpu", "cuda"):
        raise UserInputError(f"graphmem run: unknown device {device!r}; expected cpu or cuda")
    if isinstance(program, str):
        program = make_program(program, tuple(argv), module=module, steps=steps, nproc_per_node=nproc_per_node,
                               nnodes=nnodes, write_through=tuple(write_through))
    scratch = {str(op) for op in rules_for(device).scratch}
    cuda = _gpu_and_allocator(gpu or DEFAULT_GPU, alloc_conf) if device == "cuda" else None
    chosen = program_ranks(ranks, program.world_size)

    def one(rank: int, mailbox: Mailbox, cut: bool = False) -> _RankRun:
        target = None
        if cuda is not None:
            def memory(trace: Trace, since: int) -> GpuMemory:
                if not trace.ops:  # asked before the program ran an op: nothing allocated yet
                    return GpuMemory(0, 0, 0, 0)
                report = build_mode_report(trace, compute_lifetimes(trace, policy), scratch)
                stats = model_cuda_allocator(report, *cuda)
                allocated, reserved = stats.peaks_from(since)
                return GpuMemory(stats.allocated_end_bytes, stats.reserved_end_bytes, allocated, reserved)

            target = GpuTarget(cuda[0].product, cuda[0].total_memory_bytes, cuda[0].compute_capability,
                               CudaKernels(cuda[0], sdpa), memory)
        progress.show(f"running {program.command}" + (f" as rank {rank}" if program.world_size > 1 else "")
                      + (", its model's repeated blocks recorded once" if cut else ""))
        traced = trace_program(program, gpu=target, rank=rank, cut=cut, mailbox=mailbox)
        progress.show(f"analysing {len(traced.trace.ops):,} ops")
        report = build_mode_report(traced.trace, compute_lifetimes(traced.trace, policy), scratch)
        if cuda is not None and target is not None:
            stats = model_cuda_allocator(report, *cuda)
            if traced.communicators:  # NCCL's own buffers, one set per communicator, outside the allocator
                stats = replace(stats, nccl_buffer_bytes=nccl_buffer_bytes(traced.communicators))
            report = replace(report, allocator=stats, sdpa_backends=dict(target.kernels.backends))
        return _RankRun(report, traced.models[0] if traced.models else program.target, traced.exchanged,
                        traced.failed, traced.wrote)

    def repeated(rank: int, mailbox: Mailbox) -> _RankRun:
        """The rank recorded with its model's stack of alike blocks cut to four (graphmem.trace.
        program.stacks), a backup of the program kept whole from that moment in case the cut
        recording does not stand: the program starts once (graphmem.trace.program.backup)."""
        cut = os.environ.get("GRAPHMEM_REPEATED_BLOCKS", "1") != "0"
        return forked(rank, mailbox, cut) if program.world_size > 1 else one(rank, mailbox, cut)

    def forked(rank: int, mailbox: Mailbox, cut: bool = False) -> _RankRun:  # a graph does not pickle
        run = one(rank, mailbox, cut)
        return replace(run, report=with_graph(run.report, torch.fx.Graph()))

    def record(ranks: Sequence[int], mailbox: Mailbox) -> list[_RankRun | Waits]:
        def attempt(rank: int) -> _RankRun | Waits:
            try:
                return repeated(rank, mailbox)
            except Waits as waits:  # recorded again once the rank it waits for is
                return waits

        if program.world_size > 1:  # each rank a process of its own, as torchrun starts them: its own imports
            return fork_each(attempt, ranks, what="running a rank of the program")
        return [attempt(rank) for rank in ranks]

    runs, added = _record_program_ranks(record, chosen, stage_ranks=ranks == "auto")
    recorded = sorted(runs.items())
    train, model = recorded[0][1].report, recorded[0][1].model
    if program.world_size > 1:
        reports = sorted((RankReport(rank, (rank,), run.report) for rank, run in recorded),
                         key=lambda r: (-r.report.budget_peak_bytes, r.rank))
        why = [*(["rank 0 and the last"] if ranks == "auto" else []), *added]
        note = (f"ranks {', '.join(str(rank) for rank, _ in recorded)} of {program.world_size} recorded"
                + (f" ({'; '.join(why)}; --ranks all records every rank)" if why else ""))
        train = replace(reports[0].report, ranks=tuple(reports),
                        assumptions=(*reports[0].report.assumptions, note))
    failed = [(rank, run.failed) for rank, run in recorded if run.failed]
    failure = None
    if failed:
        failure = failed[0][1] + (f" (rank {failed[0][0]})" if program.world_size > 1 else "")
    return MemoryReport(target=model, device=device, inputs=(), inference=None, train=train,
                        program=program.command, gpu=cuda[0] if cuda else None,
                        parallel=f"{program.world_size} processes" if program.world_size > 1 else None,
                        program_failed=failure, program_files=recorded[0][1].wrote)


def program_allocator_again(report: MemoryReport, alloc_conf: str | None) -> MemoryReport:
    """``run_program``'s report on a GPU with the caching allocator modelled again under
    ``alloc_conf`` (None: the environment's): the recordings stand, the program does not run
    again (a verdict's what-if of expandable segments).  The rank shown first is again the one
    with the highest peak."""
    gpu, train = report.gpu, report.train
    assert gpu is not None and train is not None, "program_allocator_again: a program's report on a GPU"
    config = _gpu_and_allocator(gpu.name, alloc_conf)[1]

    def again(mode: ModeReport) -> ModeReport:
        nccl = mode.allocator.nccl_buffer_bytes if mode.allocator is not None else 0
        return replace(mode, allocator=replace(model_cuda_allocator(mode, gpu, config), nccl_buffer_bytes=nccl))

    if not train.ranks:
        return replace(report, train=again(train))
    ranks = sorted((replace(r, report=again(r.report)) for r in train.ranks),
                   key=lambda r: (-r.report.budget_peak_bytes, r.rank))
    return replace(report, train=replace(ranks[0].report, ranks=tuple(ranks), assumptions=train.assumptions))


@dataclass(frozen=True)
class _RankRun:
    """One rank of a program, recorded and analysed: its report, its model's class, and what
    its pipeline stages sent and assumed."""

    report: ModeReport
    model: str
    exchanged: Exchanged
    failed: str | None = None  # how the program failed after recording steps
    wrote: tuple[FileChange, ...] = ()  # what it did to files, in its own layer


def _record_program_ranks(record: Callable[[Sequence[int], Mailbox], list[_RankRun | Waits]],
                          chosen: Sequence[int], *, stage_ranks: bool) -> tuple[dict[int, _RankRun], tuple[str, ...]]:
    """Each rank of ``chosen`` recorded by ``record`` (several at once), until the messages
    between pipeline stages agree (graphmem.trace.program.stage_messages): a rank that waits
    for another's message is recorded again after it (that rank recorded too, if not chosen),
    one whose assumed message a later recording contradicts is recorded again; each round's
    recordings read what the rounds before sent.  ``stage_ranks``: also the first rank of each pipeline
    stage.  Returns the recordings by rank, and why ranks not chosen were recorded ("2, 3: the
    first rank of each pipeline stage"; none: empty).

    Raises:
        TraceError: a round in which no rank ended and no message was sent (the ranks wait for
            each other), or more rounds than four for each rank recorded (the ranks keep
            contradicting each other).
    """
    runs: dict[int, _RankRun] = {}
    pending, why = sorted(set(chosen)), dict[int, str]()
    rounds, sent_before, mailbox = 0, -1, Mailbox()
    while True:
        rounds += 1
        waiting: dict[int, Waits] = {}
        for rank, result in zip(pending, record(pending, mailbox), strict=True):
            if isinstance(result, Waits):
                waiting[rank] = result
            else:
                runs[rank] = result
        sent = {key: message for run in runs.values() for key, message in run.exchanged.sent.items()}
        for waits in waiting.values():
            sent.update(waits.sent)
        if not set(pending) - set(waiting) and len(sent) == sent_before or rounds > 4 * (len(runs) + len(waiting)) + 8:
            break
        mailbox, sent_before = Mailbox(sent), len(sent)
        again = {rank for rank, run in runs.items() if mailbox.contradicts(run.exchanged.assumed)}
        for rank in again:
            del runs[rank]
        senders = {w.sender for w in waiting.values() if not mailbox.find(w.key)[0]}
        stages = set(runs[0].exchanged.stages.values()) if stage_ranks and 0 in runs else set()
        for rank in sorted((senders | stages) - set(chosen) - set(why)):
            why[rank] = "the pipeline stages the others wait for" if rank in senders else \
                "each pipeline stage's first rank"
        pending = sorted(set(waiting) | again | ((senders | stages) - set(runs)))
        if not pending:
            reasons = {reason: [r for r in sorted(why) if why[r] == reason] for reason in dict.fromkeys(why.values())}
            return runs, tuple(f"{', '.join(map(str, ranks))}: {reason}" for reason, ranks in reasons.items())
    stuck = ", ".join(f"rank {rank}: {waits}" for rank, waits in waiting.items())
    raise TraceError(f"the program's pipeline stages wait for each other's messages ({stuck}); graphmem "
                     "records each rank alone and could not order them")


def program_ranks(ranks: str | Sequence[int], world: int) -> tuple[int, ...]:
    """The ranks ``--ranks`` names: ``auto`` (rank 0 and the last; pipeline stages' first ranks
    are added once rank 0 has been recorded), ``all``, or a list ("0,7").

    Raises:
        UserInputError: a rank outside the world, or text that names none.
    """
    if isinstance(ranks, str):
        if ranks == "auto":
            return tuple(sorted({0, world - 1}))
        if ranks == "all":
            return tuple(range(world))
        try:
            ranks = [int(r) for r in ranks.split(",") if r.strip()]
        except ValueError:
            raise UserInputError(f"--ranks {ranks!r}: expected auto, all or ranks such as 0,7") from None
    outside = [r for r in ranks if not 0 <= r < world]
    if not ranks or outside:
        raise UserInputError(f"--ranks: {', '.join(map(str, outside)) or 'none given'}; the ranks are 0 to {world - 1}")
    return tuple(sorted(set(ranks)))


def _finetune_text(job: Job) -> str | None:
    """What the report says was done to train only part of the model."""
    if job.lora and job.quantize_base:
        return f"{job.lora}, base weights in {job.quantize_base}"
    return str(job.lora) if job.lora else ("frozen: " + ", ".join(job.freeze) if job.freeze else None)


def _labels_from_ids(module: Any, specs: list[InputSpec], step: StepConfig) -> list[InputSpec] | None:
    """A causal language model trained without labels: the inputs plus ``labels`` shaped like
    ``input_ids`` (its own loss then runs, as trainers run it); None otherwise."""
    names = {s.name for s in specs}
    forward = getattr(module, "forward", None)
    causal = type(module).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    if step.loss != "auto" or not causal or "input_ids" not in names or "labels" in names or forward is None \
            or "labels" not in inspect.signature(forward).parameters:
        return None
    ids = next(s for s in specs if s.name == "input_ids")
    return [*specs, replace(ids, name="labels")]


def _generation(gen: GenerateSpec, run: Callable[[str, list[InputSpec]], ModeReport]) -> GenerateReport:
    """Prefill of the prompt, then the last decode step with the cache of prompt + new - 1 tokens."""
    ids = lambda n: InputSpec((gen.batch, n), torch.int64, "input_ids")
    prefill = run("prefill", [ids(gen.prompt)])
    decode = run("decode", [ids(gen.prompt + gen.new - 1), InputSpec((gen.batch, 1), torch.int64, "next_token")])
    decode_steps = [i for i, op in enumerate(decode.trace.ops) if op.phase == Phase.DECODE]
    return GenerateReport(prompt_tokens=gen.prompt, new_tokens=gen.new, batch=gen.batch,
                          prefill_peak_bytes=prefill.peak_bytes,
                          decode_peak_bytes=max(decode.timeline[i] for i in decode_steps),
                          kv_cache_bytes=decode.trace.kv_cache_bytes, prefill=prefill, decode=decode)


def _cuda_target(job: Job) -> tuple[GPU, AllocatorConfig] | None:
    """The GPU preset and allocator settings of a CUDA target (None for cpu)."""
    return _gpu_and_allocator(job.gpu, job.alloc_conf) if job.device == "cuda" else None


def _gpu_and_allocator(gpu: str, alloc_conf: str | None) -> tuple[GPU, AllocatorConfig]:
    """The GPU preset and the allocator settings (``alloc_conf`` None: PYTORCH_CUDA_ALLOC_CONF)."""
    text = alloc_conf_from_environment() if alloc_conf is None else alloc_conf
    return get_gpu(gpu), parse_alloc_conf(text)


def _cuda_default_impl(step: StepConfig) -> str:
    """PyTorch's own pick for CUDA parameters: foreach where the optimizer has it."""
    if step.optimizer_impl != "auto" or step.optimizer == "none":
        return step.optimizer_impl
    cls, _ = resolve_optimizer(step.optimizer)
    return "foreach" if "foreach" in inspect.signature(cls.__init__).parameters else "auto"
