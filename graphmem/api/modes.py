"""The modes a job asks for, each recorded and analysed: inference, the training step (and the
step without its checkpointing), generation's prefill and decode; every distinct rank of a
parallel job.

Input: a checked ``Job``, its model built once (``build``), the storage release policy and
what records one mode (graphmem.trace's ``record_step``, or a replay of recordings made
before).  Output: the ``MemoryReport``.  Each trace goes through graphmem.memory.analyse, as a
program's ranks do (graphmem.api.run_program).  Prints nothing but progress, parses no option.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from graphmem._torch_api import OpOverload
from graphmem.job.assume import Assumptions
from graphmem.job.finetune import count_trained, prepare_finetuning
from graphmem.job.generation import GenerateSpec
from graphmem.job.job import Job
from graphmem.job.load import construct_model, resolve_target
from graphmem.job.option import spelling
from graphmem.job.sections import Finetune
from graphmem.job.spec import InputSpec
from graphmem.job.step import StepConfig, resolve_optimizer
from graphmem.memory.analyse import CudaSetup, analyse, highest_first
from graphmem.memory.results import GenerateReport, MemoryReport, ModeReport, RankReport, with_graph
from graphmem.process import interrupts, progress
from graphmem.process.workers import fork_map, forked_autograd_works, processes
from graphmem.records import Phase, Trace
from graphmem.trace import CudaKernels, Recording, distinct_ranks, forks_ranks, record_ranks
from graphmem.trace.rules import Rule, RuleTable, rules_for

__all__ = ["Built", "build", "report_modes"]


@dataclass(frozen=True, slots=True)
class Built:
    """What every recording of a job shares: the built model and the target's rules."""

    module: torch.nn.Module
    dtype: torch.dtype | None
    step: StepConfig
    cuda: CudaSetup | None
    table: RuleTable
    assume: Assumptions
    modeled: frozenset[str]
    notes: tuple[str, ...]


def build(job: Job, rules: Mapping[OpOverload, Rule] | None) -> Built:
    """Build the model (on the meta device), apply fine-tuning, resolve the target."""
    target = job.target.cuda
    step, cuda = job.step, CudaSetup.of(target.gpu, target.alloc_conf) if target is not None else None
    if cuda is not None:
        step = replace(step, optimizer_impl=_cuda_default_impl(step))
    assert job.model.target is not None, "build: a resolved job has a model"
    source = resolve_target(job.model.target) if isinstance(job.model.target, str) else job.model.target
    progress.show(f"building {job.target_name}")
    built = construct_model(source, job.model.kwargs, job.model.hf_config, device=job.device)
    tuning = job.finetune or Finetune()
    module = prepare_finetuning(built.module, tuning.freeze, tuning.lora, dtype=job.model.dtype,
                                owned=not isinstance(source, torch.nn.Module), quantize=tuning.quantize_base)
    dtype = None if tuning.lora is not None else job.model.dtype  # LoRA: converted before peft, as trainers do
    interrupts.check()
    table = rules_for(job.device, rules)
    return Built(module=module, dtype=dtype, step=step, cuda=cuda, table=table,
                 assume=Assumptions.of(job.inputs.assume),
                 modeled=frozenset(str(op) for op in table.scratch),
                 notes=(built.note,) if built.note else ())  # how it was built, when not on the meta device


@dataclass(frozen=True, slots=True)
class _Modes:
    """One analysis of a job: how each of its modes is recorded (``trace_of``, with
    graphmem.trace.record_step's arguments; ``base``, the recording each mode changes) and
    analysed.  ``fork_ranks``: the distinct ranks of a parallel job are recorded side by side."""

    job: Job
    built: Built
    policy: str
    trace_of: Callable[..., Trace]
    base: Recording
    fork_ranks: bool


def report_modes(job: Job, built: Built, policy: str, trace_of: Callable[..., Trace], specs: list[InputSpec], *,
                 fork_ranks: bool = False, checkpoint_comparison: bool = True) -> MemoryReport:
    """Record (``trace_of``) and analyse each mode the job asks for.  ``fork_ranks``: the
    distinct ranks of a parallel job are recorded side by side: ZeRO-1's from one shared
    beginning (graphmem.trace.ranks.record_ranks), others in worker processes (graphmem.process.workers)
    when there are cores for them; ``checkpoint_comparison``: a checkpointed step is also
    analysed without checkpointing."""
    base = Recording(inputs=tuple(specs), device=job.device, dtype=built.dtype, rules=built.table, assume=built.assume,
                     parallel=job.parallel, sample=job.inputs.sample.by_name if job.inputs.sample else {})
    modes = _Modes(job, built, policy, trace_of, base, fork_ranks)
    gpu, step = built.cuda.gpu if built.cuda else None, built.step
    if job.generate is not None:
        gen = job.generate
        return MemoryReport(target=job.target_name, device=job.device,
                            inputs=(f"generate {gen.prompt}+{gen.new} x {gen.batch}",), inference=None, train=None,
                            gpu=gpu, generate=_generation(gen, lambda m, s: _run_mode(modes, m, step, s)))
    inference = _run_mode(modes, "inference", step) if job.mode in ("inference", "both") else None
    labelled = _labels_from_ids(built.module, specs, step)
    train = _run_mode(modes, "train", step, labelled) if job.mode in ("train", "both") else None
    baseline = (_run_mode(modes, "train", replace(step, checkpoint=None), labelled)
                if train and step.checkpoint and checkpoint_comparison else None)
    if labelled and train is not None:
        note = ("training: no labels were given, so the input ids are used as labels (a copy, as causal "
                f"language-model trainers pass them); give labels=... or {spelling('loss')} to change it")
        train = replace(train, assumptions=(*train.assumptions, note))
    return MemoryReport(target=job.target_name, device=job.device, inputs=tuple(str(s) for s in specs),
                        inference=inference, train=train, train_without_checkpoint=baseline, gpu=gpu,
                        parallel=job.parallel.text if job.parallel else None,
                        loss=(train.trace.loss or step.loss) if train is not None else None,
                        trained=count_trained(built.module, _finetune_text(job)) if train is not None else None)


def _run_mode(modes: _Modes, mode: str, step: StepConfig, inputs: Sequence[InputSpec] | None = None) -> ModeReport:
    """One mode's report (``inputs``: in place of the job's); of a parallel job, the distinct
    rank's with the highest peak, holding every distinct rank's."""
    recording = replace(modes.base, mode=mode, step=step, inputs=tuple(inputs or modes.base.inputs))
    if modes.job.parallel is None:
        return _one(modes, recording)
    distinct = distinct_ranks(modes.built.module, modes.job.parallel)
    reports = _rank_reports(modes, recording, [rank for rank, _ in distinct])
    return highest_first(RankReport(rank, alike, report)
                         for report, (rank, alike) in zip(reports, distinct, strict=True))


def _rank_reports(modes: _Modes, recording: Recording, ranks: list[int]) -> list[ModeReport]:
    """Each of ``ranks`` recorded and analysed: side by side where ``modes.fork_ranks`` allows
    (the graphs of those recorded elsewhere built again here when asked for), else in turn."""
    if modes.fork_ranks and recording.mode == "train" and forks_ranks(modes.job.parallel, ranks):
        # ZeRO-1: the ranks share their beginning
        progress.show(f"recording the training step on ranks {', '.join(map(str, ranks))}")
        made = record_ranks(modes.built.module, recording, ranks, cuda=_kernels(modes))
        reports = [_analysed(modes, trace, backends) for trace, backends in made]
        here = 1  # the first rank was recorded in this process: its graph is here
    elif modes.fork_ranks and len(ranks) > 1 and processes() > 1 and forked_autograd_works():  # each in a worker
        reports = fork_map(lambda r: with_graph(_one(modes, replace(recording, rank=r)), torch.fx.Graph()), ranks,
                           what="recording a rank")
        here = 0
    else:
        return [_one(modes, replace(recording, rank=rank)) for rank in ranks]
    return reports[:here] + [with_graph(report, partial(_graph, modes, replace(recording, rank=rank)))
                             for report, rank in zip(reports[here:], ranks[here:], strict=True)]


def _one(modes: _Modes, recording: Recording) -> ModeReport:
    """One recording of one rank, analysed."""
    kernels = _kernels(modes)
    what = {"train": "the training step", "inference": "inference"}.get(recording.mode, recording.mode)
    progress.show(f"recording {what}" + (f" on rank {recording.rank}" if modes.job.parallel is not None else ""))
    trace = modes.trace_of(modes.built.module, recording, cuda=kernels)
    return _analysed(modes, trace, dict(kernels.backends) if kernels else None)


def _analysed(modes: _Modes, trace: Trace, backends: dict[str, int] | None) -> ModeReport:
    """The trace's report (graphmem.memory.analyse); ``backends``: the attention kernels chosen."""
    interrupts.check()
    progress.show(f"analysing {len(trace.ops):,} ops")
    report = analyse(trace, policy=modes.policy, modeled=modes.built.modeled, cuda=modes.built.cuda,
                     parallel=modes.job.parallel, sdpa_backends=backends, notes=modes.built.notes)
    interrupts.check()
    return report


def _graph(modes: _Modes, recording: Recording) -> torch.fx.Graph:
    """A rank's fx graph, recorded again here (it was recorded in another process)."""
    return modes.trace_of(modes.built.module, recording, cuda=_kernels(modes)).graph


def _kernels(modes: _Modes) -> CudaKernels | None:
    """A new count of the CUDA target's kernel choices (None for the CPU)."""
    return CudaKernels(modes.built.cuda.gpu, modes.job.target.sdpa) if modes.built.cuda else None


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


def _finetune_text(job: Job) -> str | None:
    """What the report says was done to train only part of the model."""
    return str(job.finetune) if job.finetune is not None else None


def _cuda_default_impl(step: StepConfig) -> str:
    """PyTorch's own pick for CUDA parameters: foreach where the optimizer has it."""
    if step.optimizer_impl != "auto" or step.optimizer == "none":
        return step.optimizer_impl
    cls, _ = resolve_optimizer(step.optimizer)
    return "foreach" if "foreach" in inspect.signature(cls.__init__).parameters else "auto"
