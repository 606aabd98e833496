"""``graphmem plan``: a what-if table of the remedies for a job's memory, alone and combined,
ranked by what to try first, and a paragraph explaining the numbers.

Input: a ``Job`` with concrete inputs and a ``Budget``.  Output: a frozen ``Plan``.

Training remedies: the largest batch that fits, activation checkpointing of each repeated
block class, bf16/fp16 autocast, SGD / SGD with momentum / AdamW / 8-bit AdamW, gradient
accumulation, ZeRO-1 and FSDP2 (with and without resharding after forward) over N GPUs
(analysed by running the engines), CPU offload of the optimizer (formula),
torch.nn.utils.prune (analysed) and layers made smaller (formula).  Inference remedies: the
largest batch, bf16/fp16 weights, bf16/fp16 autocast, int8/int4 weight-only quantization
(formula), pruning (analysed, and CSR storage by formula).

Rows are ranked: those that fit first, then by how much they change what is trained (the
same math < other numerics < different training), then by effort (a setting < changing the
weights < more hardware), then by extra compute per sample, then by peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from graphmem.api import analyze
from graphmem.errors import GraphmemError, UserInputError
from graphmem.job.job import Job
from graphmem.job.load import resolve_target
from graphmem.job.spec import validate_inputs
from graphmem.memory.results import MemoryReport
from graphmem.preflight.budget import Budget
from graphmem.preflight.check import Prediction, SearchResult, peak_of, search_largest
from graphmem.preflight.explain import explain
from graphmem.preflight.model_facts import model_facts
from graphmem.preflight.rows import (
    Analysed,
    PlanContext,
    PlanRow,
    accumulation_rows,
    amp_rows,
    analysed_row,
    batch_templates,
    checkpoint_rows,
    half_precision_rows,
    implementation_rows,
    optimizer_rows,
    prune_rows,
    quantization_rows,
    sharding_rows,
    sparse_row,
)

__all__ = ["Plan", "PlanRow", "make_plan", "rank_rows"]

# what a combination adds, cheapest first; one remedy of each kind
_COMBINABLE = ("optimizer_impl", "amp", "optimizer", "grad_accum", "checkpoint")


@dataclass(frozen=True, slots=True)
class Plan:
    """``graphmem plan``'s answer.  ``rows`` are ranked (see the module docstring)."""

    target: str
    mode: str
    device: str
    inputs: tuple[str, ...]
    budget: Budget
    baseline: PlanRow
    rows: tuple[PlanRow, ...]
    explanation: str
    train_peak_bytes: int | None
    inference_peak_bytes: int | None
    bytes_per_sample: int | None
    skipped: tuple[str, ...]  # remedies that could not be analysed, with the reason


def rank_rows(rows: list[PlanRow]) -> list[PlanRow]:
    """Fits first; then what changes least what is trained (the same math, then other numerics,
    then different training: PlanRow.tier); then least effort (a setting < the weights < more
    hardware), least extra compute; then, of rows that fit, the smallest change."""
    # among rows that fit, the smallest change (the highest peak); among the others, the lowest peak
    return sorted(rows, key=lambda r: (not r.fits, r.tier, r.effort, round(r.extra_compute or 0.0, 3),
                                       r.peak_bytes if not r.fits else -r.peak_bytes))


def make_plan(job: Job, budget: Budget, *, world_size: int = 8, prune_amount: float = 0.5,
              group_size: int = 128) -> Plan:
    """Predict every remedy for ``job`` against ``budget``.

    Args:
        world_size: GPUs the ZeRO / FSDP rows shard over.
        prune_amount: share of each prunable weight the pruning rows remove.
        group_size: int4 quantization group size.

    Returns:
        The Plan (sizes in bytes).
    """
    validate_inputs(job.inputs, symbolic=False)
    ctx, both = _context(job, budget, world_size, prune_amount, group_size)
    found: list[Analysed | str] = []
    search = _batch_row(ctx, found)
    found += _alone_rows(ctx)
    found += _combined_rows(ctx, [a for a in found if isinstance(a, Analysed)])
    rows = [a.row for a in found if isinstance(a, Analysed)]
    train_peak = peak_of(both, "train") if both.train else None
    inference_peak = peak_of(both, "inference") if both.inference else None
    per_sample = search.bytes_per_unit if search and job.mode == "train" else None
    text = explain(both.train, both.inference, train_peak or 0, inference_peak or 0, per_sample)
    return Plan(target=str(both.target), mode=job.mode, device=both.device, inputs=both.inputs, budget=budget,
                baseline=_baseline_row(ctx), rows=tuple(rank_rows(rows)), explanation=text,
                train_peak_bytes=train_peak, inference_peak_bytes=inference_peak, bytes_per_sample=per_sample,
                skipped=tuple(a for a in found if isinstance(a, str)))


def _context(job: Job, budget: Budget, world_size: int, prune_amount: float, group_size: int
             ) -> tuple[PlanContext, MemoryReport]:
    """Resolve the model, analyse the baseline in both modes, read the model's structure."""
    job = job.with_preset()
    if job.model is None:
        raise UserInputError("no model given: pass TARGET (pkg.module:Attr) or --preset NAME")
    source = resolve_target(job.model) if isinstance(job.model, str) else job.model
    job = replace(job, model=source, name=job.target_name)
    both = _analyze_both(job)
    base = Prediction(peak_of(both, job.mode), both)
    if job.mode == "train":
        base = Prediction(base.peak_bytes, replace(both, inference=None))
    else:
        base = Prediction(base.peak_bytes, replace(both, train=None))
    batch, templates = batch_templates(job.inputs)
    facts = model_facts(source, job.model_kwargs, job.dtype, job.hf_config, job.device)
    ctx = PlanContext(job=job, source=source, budget=budget, base=base,
                      batch=batch, templates=templates, facts=facts, world_size=world_size,
                      prune_amount=prune_amount, group_size=group_size)
    return ctx, both


def _analyze_both(job: Job) -> MemoryReport:
    """The baseline in both modes (the explanation compares them); the job's mode alone when
    the other cannot be analysed."""
    try:
        return analyze(replace(job, mode="both"))
    except GraphmemError:
        return analyze(job)


def _baseline_row(ctx: PlanContext) -> PlanRow:
    peak = ctx.base.peak_bytes
    return PlanRow(name="as given", changes={}, peak_bytes=peak, saving_bytes=0, extra_compute=0.0,
                   fits=ctx.budget.fits(peak), source="analysis")


def _batch_row(ctx: PlanContext, found: list[Analysed | str]) -> SearchResult | None:
    """The largest batch that fits (searched), as a row; the search for its bytes per sample."""
    if ctx.batch is None:
        found.append("smaller batch: the first input has no batch dimension")
        return None
    try:
        search = search_largest(replace(ctx.job, inputs=ctx.templates), ctx.budget)
    except GraphmemError as exc:
        found.append(f"largest batch: not searched ({exc})")
        return None
    batch = max(search.max_value, 1)
    accum = -(-ctx.batch // batch)
    per = f"{search.bytes_per_unit:,} B per sample" if search.bytes_per_unit is not None else ""
    keep = f"keep {ctx.batch} samples per step with {accum} accumulation steps"
    note = "; ".join(n for n in (per, keep if ctx.job.mode == "train" and batch < ctx.batch else "") if n)
    name = (f"batch {batch} (the largest that fits)" if search.max_value
            else "batch 1 (the smallest; does not fit)")
    found.append(analysed_row(ctx, name, {"batch": batch}, note=note))
    return search


def _alone_rows(ctx: PlanContext) -> list[Analysed | str]:
    if ctx.job.mode == "train":
        return [*implementation_rows(ctx), *checkpoint_rows(ctx), *amp_rows(ctx), *optimizer_rows(ctx),
                *accumulation_rows(ctx), *prune_rows(ctx), *sharding_rows(ctx)]
    return [*half_precision_rows(ctx), *amp_rows(ctx), *quantization_rows(ctx), *prune_rows(ctx),
            *([sparse_row(ctx)] if ctx.facts.prunable_weights else [])]


def _combined_rows(ctx: PlanContext, alone: list[Analysed]) -> list[Analysed | str]:
    """Combinations of the best analysed remedy of each kind, cheapest first: each adds the next
    remedy to the best combination so far (kept only if it lowers the peak), up to the first
    that fits; then the formulas on top of the best one while nothing fits."""
    if ctx.job.mode != "train":
        halves = [a for a in alone if "dtype" in a.row.changes and a.prediction is not None]
        best_half = min(halves, key=lambda a: a.row.peak_bytes, default=None)
        return list(quantization_rows(ctx, best_half)) if best_half else []
    picks = _best_of_each_kind(alone)
    if not picks or picks[0].row.fits:
        return []
    out: list[Analysed | str] = []
    best = picks[0]
    for pick in picks[1:]:
        name = f"{best.row.name} + {pick.row.name}"
        made = analysed_row(ctx, name, {**best.row.changes, **pick.row.changes})
        out.append(made)
        if isinstance(made, Analysed) and made.row.peak_bytes < best.row.peak_bytes:
            best = made
            if best.row.fits:
                return out
    return out + sharding_rows(ctx, best)


def _best_of_each_kind(alone: list[Analysed]) -> list[Analysed]:
    """The analysed row that saves the most for each combinable kind, cheapest first."""
    best: dict[str, Analysed] = {}
    for a in alone:
        kinds = [k for k in _COMBINABLE if k in a.row.changes]
        if a.prediction is None or a.row.saving_bytes <= 0 or not kinds:
            continue
        if kinds[0] not in best or a.row.saving_bytes > best[kinds[0]].row.saving_bytes:
            best[kinds[0]] = a
    return sorted(best.values(), key=lambda a: (a.row.tier, round(a.row.extra_compute or 0.0, 3),
                                                -a.row.saving_bytes))

