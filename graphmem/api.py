"""analyze(): the stages in order — job, load, trace, liveness, memory model — nothing else."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from graphmem import interrupts, progress
from graphmem.cuda.alloc_conf import AllocatorConfig, parse_alloc_conf
from graphmem.cuda.gpus import GPU, get_gpu
from graphmem.errors import UserInputError
from graphmem.job.finetune import count_trained, prepare_finetuning
from graphmem.job.job import Job, make_job
from graphmem.job.load import ModelSource, construct_model, resolve_target
from graphmem.job.spec import GenerateSpec, InputSpec, input_symbol, parse_input_spec, validate_inputs
from graphmem.job.step import StepConfig, resolve_optimizer
from graphmem.memory.cuda_replay import model_cuda_allocator
from graphmem.memory.liveness import POLICIES, compute_lifetimes
from graphmem.memory.mode_report import build_mode_report
from graphmem.memory.results import GenerateReport, MemoryReport, ModeReport, RankReport
from graphmem.trace.cuda_kernels import CudaKernels
from graphmem.trace.parallel import distinct_ranks
from graphmem.trace.records import Phase
from graphmem.trace.rules import Rule, rules_for
from graphmem.trace.tracer import trace_step

__all__ = ["analyze"]


def analyze(job: Job | str | ModelSource | None = None,
            inputs: Sequence[InputSpec | str | torch.Tensor] | InputSpec | str | torch.Tensor = (),
            *, rules: Mapping[torch._ops.OpOverload, Rule] | None = None, policy: str = "observed",
            **keywords: Any) -> MemoryReport:
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
    if not isinstance(job, Job):
        job = make_job(keywords.pop("model", job), keywords.pop("inputs", inputs), **keywords)
    elif inputs or keywords:
        job = job.updated(**({"inputs": inputs} if inputs else {}), **keywords)
    if policy not in POLICIES:
        raise UserInputError(f"unknown policy {policy!r}; expected one of: {', '.join(POLICIES)}")
    job = job.with_preset()
    if not job.inputs and job.generate is None:
        raise UserInputError("no input given; pass at least one --input such as 32x1000")
    if input_symbol(job.inputs) is not None:
        validate_inputs(job.inputs, symbolic=False)
    step, cuda = job.step, _cuda_target(job)
    if cuda is not None:
        step = replace(step, optimizer_impl=_cuda_default_impl(step))
    if job.model is None:
        raise UserInputError("no model given: pass TARGET (pkg.module:Attr) or --preset NAME")
    source = resolve_target(job.model) if isinstance(job.model, str) else job.model
    progress.show(f"building {job.target_name}")
    built = construct_model(source, job.model_kwargs, job.hf_config, device=job.device)
    module = prepare_finetuning(built.module, job.freeze, job.lora, dtype=job.dtype,
                                owned=not isinstance(source, torch.nn.Module))
    dtype = None if job.lora is not None else job.dtype  # LoRA: converted before peft, as trainers do
    interrupts.check()
    built_notes = (built.note,) if built.note else ()  # how it was built, when not on the meta device
    table = rules_for(job.device, rules)
    modeled = {str(op) for op in table.scratch}
    specs = [parse_input_spec(text) for text in job.inputs]

    def one(m: str, config: StepConfig, inputs: Sequence[InputSpec] | None, rank: int) -> ModeReport:
        kernels = CudaKernels(cuda[0], job.sdpa) if cuda else None
        what = {"train": "the training step", "inference": "inference"}.get(m, m)
        progress.show(f"recording {what}" + (f" on rank {rank}" if job.parallel is not None else ""))
        trace = trace_step(module, inputs or specs, mode=m, step=config, device=job.device, dtype=dtype,
                           rules=table, cuda=kernels, assume=job.assume, parallel=job.parallel, rank=rank)
        interrupts.check()
        progress.show(f"analysing {len(trace.ops):,} ops")
        report = build_mode_report(trace, compute_lifetimes(trace, policy), modeled)
        interrupts.check()
        report = replace(report, assumptions=(*report.assumptions, *built_notes))
        if cuda is None or kernels is None:  # (kernels exist exactly when cuda does)
            return report
        return replace(report, allocator=model_cuda_allocator(report, *cuda, parallel=job.parallel),
                       sdpa_backends=dict(kernels.backends))

    def run(m: str, config: StepConfig, inputs: Sequence[InputSpec] | None = None) -> ModeReport:
        if job.parallel is None:
            return one(m, config, inputs, 0)
        ranks = [RankReport(rank, alike, one(m, config, inputs, rank))
                 for rank, alike in distinct_ranks(module, job.parallel)]
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
    baseline = run("train", replace(step, checkpoint=()), labelled) if train and step.checkpoint else None
    if labelled and train is not None:
        note = ("training: no labels were given, so the input ids are used as labels (a copy, as causal "
                "language-model trainers pass them); give labels=... or --loss to change it")
        train = replace(train, assumptions=(*train.assumptions, note))
    return MemoryReport(target=job.target_name, device=job.device, inputs=tuple(str(s) for s in specs),
                        inference=inference, train=train, train_without_checkpoint=baseline, gpu=gpu,
                        parallel=job.parallel.text if job.parallel else None,
                        loss=step.loss if train is not None else None,
                        trained=count_trained(module, _finetune_text(job)) if train is not None else None)


def _finetune_text(job: Job) -> str | None:
    """What the report says was done to train only part of the model."""
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
    if job.device != "cuda":
        return None
    text = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if job.alloc_conf is None else job.alloc_conf
    return get_gpu(job.gpu), parse_alloc_conf(text)


def _cuda_default_impl(step: StepConfig) -> str:
    """PyTorch's own pick for CUDA parameters: foreach where the optimizer has it."""
    if step.optimizer_impl != "auto" or step.optimizer == "none":
        return step.optimizer_impl
    cls, _ = resolve_optimizer(step.optimizer)
    return "foreach" if "foreach" in inspect.signature(cls.__init__).parameters else "auto"
