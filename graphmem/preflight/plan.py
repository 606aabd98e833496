"""``graphmem plan``: a what-if table of the remedies for a job's memory, alone and combined,
ranked by what to try first, and a paragraph explaining the numbers.

Input: a ``Job`` with concrete inputs and a ``Budget``.  Output: a frozen ``Plan``.

Training remedies (remedies.py): the largest batch that fits, the optimizer's fused/foreach
implementation, activation checkpointing of each repeated block class, bf16/fp16 autocast,
bf16 weights with fp32 master weights and optimizer state, bf16 weights and state, 8-bit
optimizers, SGD / SGD with momentum / AdamW, gradient accumulation, ZeRO-1 and FSDP2 over N
GPUs (only with a world size: ``--world-size N`` or the job's ``--parallel``), the optimizer
offloaded to the host, the CUDA allocator's expandable segments (all analysed),
torch.nn.utils.prune (analysed) and layers made smaller (formula).  Inference: the largest
batch, bf16/fp16 weights and autocast, expandable segments, int8/int4 weight-only quantization
(formula), pruning (analysed, and CSR storage by formula); with --generate, the KV cache in
bf16 or fp8 (formula).  Combinations: see _combined_rows.  Rows that save nothing are left
out.  Every row's peak is what the budget is compared with (graphmem/preflight/footprint.py).
Ranking: graphmem/preflight/ranking.py, the one place the rule is written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from graphmem.api import analyze
from graphmem.cuda.gpus import get_gpu
from graphmem.errors import GraphmemError, UserInputError
from graphmem.job.job import Job
from graphmem.job.load import resolve_target
from graphmem.job.option import spelling
from graphmem.job.spec import validate_inputs
from graphmem.memory.results import MemoryReport, without_graphs
from graphmem.preflight.budget import Budget
from graphmem.preflight.changes import COMBINED_KINDS, kind_of, merge
from graphmem.preflight.explain import explain
from graphmem.preflight.footprint import footprint_of
from graphmem.preflight.generation import kv_cache_rows
from graphmem.preflight.model_facts import model_facts
from graphmem.preflight.policy.search import FRONT_POINTS, PolicyPlan, make_policy, policy_job
from graphmem.preflight.policy.sharding import make_sharded_policy
from graphmem.preflight.ranking import RANKING_RULE, Departure, rank_key, rank_rows
from graphmem.preflight.remedies import (
    accumulation_rows,
    allocator_rows,
    amp_rows,
    checkpoint_rows,
    half_precision_rows,
    implementation_rows,
    offload_rows,
    optimizer_rows,
    precision_rows,
    prune_rows,
    qlora_rows,
    quantization_rows,
    sharding_rows,
    sparse_row,
)
from graphmem.preflight.rows import (
    Analysed,
    PlanContext,
    PlanRow,
    Request,
    analysed_row,
    analysed_rows,
    batch_templates,
)
from graphmem.preflight.search import Prediction, SearchResult, peak_of, search_largest
from graphmem.process import progress

__all__ = ["RANKING_RULE", "Plan", "PlanRow", "make_plan", "rank_rows"]

# kinds that need more hardware: a second chain of combinations leaves them out
_MORE_HARDWARE = frozenset({"offload"})
ALONE = "each change alone"  # the first round of rows, as progress names it


@dataclass(frozen=True, slots=True)
class Plan:
    """``graphmem plan``'s answer.  ``rows`` are ranked (see the module docstring); ``mode`` is
    "train", "inference" or "generate"."""

    target: str
    mode: str
    device: str
    inputs: tuple[str, ...]
    budget: Budget
    baseline: PlanRow
    rows: tuple[PlanRow, ...]
    explanation: str
    train_peak_bytes: int | None      # the analysis's own peaks (CUDA: allocated), as the explanation
    inference_peak_bytes: int | None  # compares them; the rows' peaks are what the budget compares
    bytes_per_sample: int | None
    skipped: tuple[str, ...]  # remedies that could not be analysed, with the reason
    world_size: int | None = None  # the GPUs the sharding rows may use (None: one, no sharding rows)
    world_source: str = ""  # where it comes from: "--world-size" or "--parallel" ("" with none)
    report: MemoryReport | None = None  # the baseline's analysis (the header's facts)
    policy: PolicyPlan | None = None  # --policy: the checkpointing policy (then the only remedy tried)

    @property
    def headroom_bytes(self) -> int:
        """Budget left after the baseline and its margin; negative: the shortfall."""
        return self.budget.total_bytes - self.budget.required_bytes(self.baseline.peak_bytes)


def make_plan(job: Job, budget: Budget, *, world_size: int | None = None, prune_amount: float = 0.5,
              group_size: int = 128, policy: bool = False, front_points: int = FRONT_POINTS,
              policy_save: Sequence[str] = (), policy_ops: bool = True) -> Plan:
    """Predict every remedy for ``job`` against ``budget``; with ``policy``, only the activation
    checkpointing policy with the least recompute that fits (graphmem.preflight.policy).

    Args:
        world_size: GPUs available: the ZeRO / FSDP rows shard over up to this many; None:
            the job's own (its ``--parallel``'s GPUs, or one: no sharding rows).
        prune_amount: share of each prunable weight the pruning rows remove.
        group_size: int4 quantization group size.
        policy: choose the blocks to checkpoint (``Plan.policy``) instead of the table of remedies.
        front_points: with ``policy``, the points of the memory/recompute front analysed.
        policy_save: with ``policy``, ``--checkpoint-save`` names (``matmuls``, ``attention``, aten
            ops): each block may also be checkpointed keeping those ops' outputs.
        policy_ops: with ``policy``, then keep single ops' outputs inside the chosen blocks where
            the budget leaves room (graphmem.preflight.policy.finer); False: per block only.

    Returns:
        The Plan (sizes in bytes).
    """
    if job.generate is None:
        validate_inputs(job.inputs.specs, symbolic=False)
    if policy:
        return _policy_plan(job, budget, front_points, tuple(policy_save), policy_ops)
    ctx, both = _context(job, budget, world_size, prune_amount, group_size)
    found: list[Analysed | str] = []
    search = _batch_row(ctx, found)
    found += _alone_rows(ctx)
    alone = [a for a in found if isinstance(a, Analysed)]
    found += _combined_rows(ctx, alone)
    found += _with_expandable_segments(ctx, [a for a in found if isinstance(a, Analysed)])
    # a row that saves nothing is no remedy (an implementation that saves nothing alone still
    # joins the combinations above: _best_of_each_kind)
    rows = _distinct([a.row for a in found if isinstance(a, Analysed) and a.row.saving_bytes != 0])
    # the explanation compares the analysis's own peaks (CUDA: allocated), not what the GPU must hold
    train_peak = footprint_of(both, "train").peak_bytes if both.train else None
    inference_peak = footprint_of(both, "inference").peak_bytes if both.inference else None
    per_sample = search.bytes_per_unit if search and ctx.mode == "train" else None
    text = explain(both.train, both.inference, train_peak or 0, inference_peak or 0, per_sample)
    return Plan(target=str(both.target), mode="generate" if job.generate else job.mode, device=both.device,
                inputs=both.inputs, budget=budget, baseline=_baseline_row(ctx), rows=tuple(rank_rows(rows)),
                explanation=text, train_peak_bytes=train_peak, inference_peak_bytes=inference_peak,
                bytes_per_sample=per_sample, skipped=tuple(a for a in found if isinstance(a, str)),
                world_size=ctx.world_size,
                world_source="--world-size" if world_size is not None else spelling("parallel") if job.parallel else "",
                report=without_graphs(both))


def _policy_plan(job: Job, budget: Budget, front_points: int, save: tuple[str, ...], ops: bool) -> Plan:
    """The plan of ``--policy``: the job as given and the checkpointing policy, no other remedy."""
    job, block_class = policy_job(job)
    ctx, both = _context(job, budget, None, 0.5, 128)
    search = make_sharded_policy if job.parallel is not None else make_policy
    chosen = search(ctx.job, budget, block_class=block_class, base=ctx.base, source=ctx.source,
                    front_points=front_points, save=save, ops=ops)
    train_peak = footprint_of(both, "train").peak_bytes if both.train else None
    inference_peak = footprint_of(both, "inference").peak_bytes if both.inference else None
    text = explain(both.train, both.inference, train_peak or 0, inference_peak or 0, None)
    return Plan(target=str(both.target), mode=job.mode, device=both.device, inputs=both.inputs, budget=budget,
                baseline=_baseline_row(ctx), rows=(), explanation=text, train_peak_bytes=train_peak,
                inference_peak_bytes=inference_peak, bytes_per_sample=None,
                skipped=("the other remedies: graphmem plan without --policy tries them",),
                report=without_graphs(both), policy=chosen)


def _distinct(rows: list[PlanRow]) -> list[PlanRow]:
    """Each set of changes once (two chains of combinations can meet)."""
    seen: dict[str, PlanRow] = {}
    for row in rows:
        seen.setdefault(repr(sorted(row.changes.items())), row)
    return list(seen.values())


def _context(job: Job, budget: Budget, world_size: int | None, prune_amount: float, group_size: int
             ) -> tuple[PlanContext, MemoryReport]:
    """Resolve the model, analyse the baseline in both modes, read the model's structure."""
    job = job.with_preset()
    if job.model.target is None:
        raise UserInputError(f"no model given: pass TARGET (pkg.module:Attr) or {spelling('preset')} NAME")
    source = resolve_target(job.model.target) if isinstance(job.model.target, str) else job.model.target
    job = replace(job, model=replace(job.model, target=source, name=job.target_name))
    with progress.labelled("the job as given"):
        both = _analyze_both(job)
    base = Prediction(peak_of(both, job.mode), both)
    if job.mode == "train":
        base = Prediction(base.peak_bytes, replace(both, inference=None))
    else:
        base = Prediction(base.peak_bytes, replace(both, train=None))
    batch, templates = batch_templates(job.inputs.specs)
    facts = model_facts(source, job.model.kwargs, job.model.dtype, job.model.hf_config, job.device)
    # bf16 needs compute capability 8.0 (Ampere) on a GPU: V100 and T4 compute in fp16
    bf16 = job.target.cuda is None or get_gpu(job.target.cuda.gpu).compute_capability >= (8, 0)
    ctx = PlanContext(job=job, source=source, budget=budget, base=base,
                      batch=batch, templates=templates, facts=facts,
                      world_size=world_size if world_size is not None else job.parallel.world_size if job.parallel
                      else None,
                      prune_amount=prune_amount, group_size=group_size, bf16=bf16)
    return ctx, both


def _analyze_both(job: Job) -> MemoryReport:
    """The baseline in both modes (the explanation compares them); the job's mode alone when
    the other cannot be analysed."""
    if job.generate is not None:
        return analyze(job)
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
    if ctx.job.generate is not None:
        return None  # the sequences generated at once are --batch: try a smaller one with check
    if ctx.batch is None:
        found.append("smaller batch: the first input has no batch dimension")
        return None
    try:
        with progress.labelled("the largest batch that fits"):
            search = search_largest(ctx.job.with_inputs(ctx.templates), ctx.budget)
    except GraphmemError as exc:
        found.append(f"largest batch: not searched ({exc})")
        return None
    if not search.max_value and ctx.batch == 1:
        return search  # the job's own batch of 1 is the smallest: no row to add
    batch = max(search.max_value, 1)
    accum = -(-ctx.batch // batch)
    per = f"{search.bytes_per_unit:,} B per sample" if search.bytes_per_unit is not None else ""
    keep = f"keep {ctx.batch} samples per step with {accum} accumulation steps"
    note = "; ".join(n for n in (per, keep if ctx.mode == "train" and batch < ctx.batch else "") if n)
    name = (f"batch {batch} (the largest that fits)" if search.max_value
            else "batch 1 (the smallest; does not fit)")
    known = search.report_at_max  # the search analysed it: no new recording
    prediction = Prediction(peak_of(known, ctx.job.mode), known) if known is not None and search.max_value else None
    found.append(analysed_row(ctx, {"batch": batch}, name=name, note=note, prediction=prediction))
    return search


def _alone_rows(ctx: PlanContext) -> list[Analysed | str]:
    """Each remedy alone; the independent analyses together (in parallel, rows.analysed_rows)."""
    if ctx.job.generate is not None:
        return analysed_rows(ctx, [*half_precision_rows(ctx), *kv_cache_rows(ctx), *quantization_rows(ctx),
                                   *allocator_rows(ctx)], stage=ALONE)
    if ctx.mode == "train":
        return analysed_rows(ctx, [*implementation_rows(ctx), *checkpoint_rows(ctx), *amp_rows(ctx),
                                   *precision_rows(ctx), *optimizer_rows(ctx), *accumulation_rows(ctx),
                                   *qlora_rows(ctx), *prune_rows(ctx), *sharding_rows(ctx), *offload_rows(ctx),
                                   *allocator_rows(ctx)], stage=ALONE)
    return analysed_rows(ctx, [*half_precision_rows(ctx), *amp_rows(ctx), *quantization_rows(ctx), *prune_rows(ctx),
                               *([sparse_row(ctx)] if ctx.facts.prunable_weights else []), *allocator_rows(ctx)],
                         stage=ALONE)


def _combined_rows(ctx: PlanContext, alone: list[Analysed]) -> list[Analysed | str]:
    """Combinations a practitioner would try, when no setting that keeps the job's math fits alone.

    Training: the best row of each kind (remedies.py; the nearest to the job's math, then
    the largest saving) in ranking order; each is added to the best combination so far and kept
    if it lowers the peak, up to the first that fits.  A second chain leaves out the kinds that
    need more hardware (offload), so the best a single GPU can do on its own shows too.  While
    nothing fits, sharding and offload on top of the best combination.  Inference: the best
    half-precision row with int8 / int4 weights."""
    if ctx.mode != "train":
        halves = [a for a in alone if "dtype" in a.row.changes and a.prediction is not None]
        best_half = min(halves, key=lambda a: a.row.peak_bytes, default=None)
        return list(quantization_rows(ctx, best_half)) if best_half else []
    if any(a.row.fits and a.row.departure <= Departure.MIXED_PRECISION and a.row.effort < 2 for a in alone):
        return []  # a setting that keeps the math fits on its own
    picks = _best_of_each_kind(alone)
    if not picks:
        return []
    seen: dict[str, Analysed | str] = {}
    out, best = _chain(ctx, picks, seen)
    if any(kind_of(p.row.changes) in _MORE_HARDWARE for p in picks):
        more, other = _chain(ctx, [p for p in picks if kind_of(p.row.changes) not in _MORE_HARDWARE], seen)
        out += more
        best = best if best.row.fits or not other.row.fits else other
    if best.row.fits:
        return out
    return out + analysed_rows(ctx, [*sharding_rows(ctx, best),
                                     *(offload_rows(ctx, best) if "offload" not in best.row.changes else [])],
                                stage="on top of the best combination")


def _with_expandable_segments(ctx: PlanContext, rows: list[Analysed]) -> list[Analysed | str]:
    """Each analysed row that saves memory but does not fit only because of the allocator's cached
    segments (its allocated peak with the CUDA context would), again with expandable segments:
    the chain of combinations stops at the first that fits and would not try it on every row."""
    near = [a for a in rows if a.prediction is not None and not a.row.fits and a.row.saving_bytes > 0
            and "alloc_conf" not in a.row.changes
            and ctx.budget.fits(footprint_of(a.prediction.report, ctx.job.mode).allocated_needed_bytes)]
    tried = {repr(sorted(a.row.changes.items())) for a in rows}
    requests = [r for a in near for r in allocator_rows(ctx, a) if isinstance(r, Request)]
    return analysed_rows(ctx, [r for r in requests if repr(sorted(r.changes.items())) not in tried],
                         stage="with expandable segments")


def _chain(ctx: PlanContext, picks: list[Analysed], seen: dict[str, Analysed | str]
           ) -> tuple[list[Analysed | str], Analysed]:
    """Add each pick to the best combination so far; keep what lowers the peak; stop at a fit.
    ``seen``: combinations already analysed (by their changes), shared between chains."""
    out: list[Analysed | str] = []
    best = picks[0]
    for pick in picks[1:]:
        changes = merge(best.row.changes, pick.row.changes)
        if changes is None or changes == best.row.changes:
            continue
        # the pick replaces what the best had (another optimizer for an implementation): no new row
        key = repr(sorted(changes.items()))
        if changes == pick.row.changes:
            made: Analysed | str = pick
        else:
            made = seen[key] if key in seen else seen.setdefault(key, _combination(ctx, changes))
        if isinstance(made, str):
            out.append(made)
        elif made.row.peak_bytes < best.row.peak_bytes:
            out += [made] if made is not pick else []
            best = made
            if best.row.fits:
                break
    return out, best


def _combination(ctx: PlanContext, changes: Mapping[str, Any]) -> Analysed | str:
    with progress.labelled(f"combination: {ctx.name(changes)}"):
        return analysed_row(ctx, changes)


def _best_of_each_kind(alone: list[Analysed]) -> list[Analysed]:
    """For each combinable kind, the analysed row nearest to the job's math that saves memory
    (the largest saving among equals; an optimizer implementation also when it saves nothing
    alone), in ranking order."""
    best: dict[str, Analysed] = {}
    for a in alone:
        kind = kind_of(a.row.changes)
        # an implementation that saves nothing alone (the peak is in backward) can lower a
        # combination's peak once checkpointing has moved it to the step: it costs nothing to try
        free = kind == "implementation" and a.row.saving_bytes == 0
        if a.prediction is None or (a.row.saving_bytes <= 0 and not free) or kind is None:
            continue
        if kind not in best or (a.row.departure, -a.row.saving_bytes) < (best[kind].row.departure,
                                                                          -best[kind].row.saving_bytes):
            best[kind] = a
    assert set(best) <= set(COMBINED_KINDS), f"_best_of_each_kind: unknown kinds {set(best)}"
    return sorted(best.values(), key=lambda a: rank_key(a.row)[1:])
