"""A plan row's changes as typed edits of the job's sections, each ``apply(job) -> Job``.

Input: a row's changes (the kinds of graphmem/preflight/changes.py, which names and ranks the
rows) and what the rows share (the baseline's inputs with their batch written ``B``, the
model's source).  Output: the edits, in the order they apply, and the job they make.  Each
edit changes one section (the step, the model, the inputs, the target, the parallelism, the
fine-tuning) through its typed fields; nothing is edited by key.  Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from graphmem.job.job import Job
from graphmem.job.parallel import parse_parallel
from graphmem.job.spec import parse_dtype, parse_input_spec, substitute
from graphmem.job.step_config import EveryBlock, Selective, names_of
from graphmem.preflight.master_weights import MASTER_WEIGHTS_OPTIMIZER

__all__ = ["Edit", "apply_edits", "edits_of"]


class Edit(Protocol):
    """One change of a job's section."""

    def apply(self, job: Job) -> Job: ...


@dataclass(frozen=True, slots=True)
class Inputs:
    """The baseline's inputs at ``batch`` (their first dimension written ``symbol`` in
    ``templates``), float inputs in ``dtype`` where the weights change to it."""

    templates: tuple[str, ...]
    symbol: str
    batch: int
    dtype: str | None = None

    def apply(self, job: Job) -> Job:
        texts = [substitute(t, self.symbol, self.batch) for t in self.templates]
        return job.with_inputs([_float_input(t, self.dtype) for t in texts] if self.dtype else texts)


@dataclass(frozen=True, slots=True)
class Step:
    """Settings of the step: another optimizer or its implementation, autocast, accumulation."""

    optimizer: str | None = None
    optimizer_impl: str | None = None
    amp: str | None = None
    grad_accum: int | None = None

    def apply(self, job: Job) -> Job:
        step = job.step
        step = replace(step, optimizer=self.optimizer) if self.optimizer is not None else step
        step = replace(step, optimizer_impl=self.optimizer_impl) if self.optimizer_impl is not None else step
        step = replace(step, amp=self.amp) if self.amp is not None else step
        step = replace(step, grad_accum=self.grad_accum) if self.grad_accum is not None else step
        return replace(job, step=step)


@dataclass(frozen=True, slots=True)
class Checkpointing:
    """Every ``every``-th block of ``classes`` checkpointed, keeping the outputs of ``save``."""

    classes: tuple[str, ...]
    every: int = 1
    save: tuple[str, ...] = ()

    def apply(self, job: Job) -> Job:
        chosen = Selective(self.classes, self.every, self.save) if self.save else EveryBlock(self.classes, self.every)
        return replace(job, step=replace(job.step, checkpoint=chosen))


@dataclass(frozen=True, slots=True)
class Weights:
    """The weights in ``dtype`` (no autocast over them); with ``master``, an fp32 master copy
    and optimizer state kept by the master-weights optimizer around the job's own."""

    dtype: str
    master: bool = False

    def apply(self, job: Job) -> Job:
        step = replace(job.step, amp=None)  # the weights themselves are in half precision: no autocast over them
        if self.master:
            step = replace(step, optimizer=MASTER_WEIGHTS_OPTIMIZER,
                           optimizer_kwargs={"inner": step.optimizer, **job.step.optimizer_kwargs})
        return replace(job, step=step, model=replace(job.model, dtype=parse_dtype(self.dtype)))


@dataclass(frozen=True, slots=True)
class Offload:
    """The optimizer step and its state on the host: the device runs forward and backward, the
    gradients leave it at the step."""

    def apply(self, job: Job) -> Job:
        return replace(job, step=replace(job.step, optimizer="none", optimizer_impl="auto"))


@dataclass(frozen=True, slots=True)
class Sharding:
    """``zero1=N`` or ``fsdp=N`` (``keep``: parameters kept after forward); the job's own engine
    settings carry over."""

    text: str
    keep: bool = False

    def apply(self, job: Job) -> Job:
        spec = replace(parse_parallel(self.text), reshard_after_forward=False if self.keep else None)
        if job.parallel is not None:
            spec = replace(spec, nccl_buffer_mb=job.parallel.nccl_buffer_mb, bucket_mb=job.parallel.bucket_mb)
        return replace(job, parallel=spec)


@dataclass(frozen=True, slots=True)
class QuantizedBase:
    """A LoRA job's frozen base quantized (QLoRA)."""

    kind: str

    def apply(self, job: Job) -> Job:
        assert job.finetune is not None, "QuantizedBase.apply: a LoRA job"
        return replace(job, finetune=replace(job.finetune, quantize_base=self.kind))


@dataclass(frozen=True, slots=True)
class Allocator:
    """The CUDA caching allocator under other PYTORCH_CUDA_ALLOC_CONF settings."""

    conf: str

    def apply(self, job: Job) -> Job:
        return replace(job, target=job.target.with_alloc_conf(self.conf))


@dataclass(frozen=True, slots=True)
class Model:
    """Another model: a factory holding the preset's class and config (a pruned copy)."""

    build: Callable[[], Any]

    def apply(self, job: Job) -> Job:
        return replace(job, model=replace(job.model, target=self.build, kwargs={}, hf_config=None,
                                          hf_config_file=None, preset=None))


def edits_of(changes: Mapping[str, Any], templates: Sequence[str], symbol: str, batch: int,
             pruned: Callable[[float, bool], Callable[[], Any]]) -> tuple[Edit, ...]:
    """The edits of a row's ``changes``, in the order they apply (``templates``: the baseline's
    inputs, their batch written ``symbol``; ``pruned(amount, remove)``: the pruned model's factory)."""
    dtype = changes.get("dtype", changes.get("master_weights"))
    edits: list[Edit] = [Inputs(tuple(templates), symbol, int(changes.get("batch", batch)), dtype),
                         Step(changes.get("optimizer"), changes.get("optimizer_impl"), changes.get("amp"),
                              changes.get("grad_accum"))]
    if "checkpoint" in changes:
        edits.append(Checkpointing(names_of(changes["checkpoint"]), int(changes.get("checkpoint_every", 1)),
                                   names_of(changes.get("checkpoint_save", ()))))
    if dtype is not None:
        edits.append(Weights(dtype, master="master_weights" in changes and "offload" not in changes))
    if "offload" in changes:
        edits.append(Offload())
    if "quantize_base" in changes:
        edits.append(QuantizedBase(changes["quantize_base"]))
    if "parallel" in changes:
        text, _, keep = str(changes["parallel"]).partition(":")
        edits.append(Sharding(text, bool(keep)))
    if "alloc_conf" in changes:
        edits.append(Allocator(changes["alloc_conf"]))
    if "prune_amount" in changes:
        edits.append(Model(pruned(changes["prune_amount"], bool(changes.get("prune_remove", False)))))
    return tuple(edits)


def apply_edits(job: Job, edits: Sequence[Edit]) -> Job:
    """``job`` with each edit applied in turn."""
    for edit in edits:
        job = edit.apply(job)
    return job


def _float_input(text: str, dtype: str) -> str:
    spec = parse_input_spec(text)
    return str(replace(spec, dtype=parse_dtype(dtype))) if spec.dtype.is_floating_point else text
