"""``make_policy``: record the step four ways, solve for the least recompute under the budget, and
analyse the job with the chosen blocks checkpointed.

Input: a training ``Job`` on one device or under ``--parallel fsdp=N`` (its model resolved), a
``Budget``, the class of the blocks.  Output: a frozen ``PolicyPlan`` (results.py).  Every peak it
holds comes from an analysis of the job with that choice applied (``--checkpoint CLASS
--checkpoint-blocks ...``, as ``graphmem analyze`` runs it; verify.py), never from the composite
alone; the composite's number is kept beside it.  refine.py keeps single ops' outputs inside the
chosen blocks afterwards.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from graphmem.errors import UnsupportedError, UserInputError
from graphmem.job.job import Job
from graphmem.job.load import ModelSource, build_model
from graphmem.job.option import spelling
from graphmem.job.step_config import EveryBlock
from graphmem.preflight.budget import Budget
from graphmem.preflight.policy.composite import Composite, Recorded, build_composite, merge_composites
from graphmem.preflight.policy.costs import CostModel, cost_model
from graphmem.preflight.policy.refine import refined
from graphmem.preflight.policy.results import CheckpointChoice, PolicyPlan, Sharding, ShardingOption
from graphmem.preflight.policy.solve import SOLVER, search_front
from graphmem.preflight.policy.verify import Choices, Verifier, analyse, analyse_all, choice_of, train_of
from graphmem.preflight.search import Prediction
from graphmem.process import progress
from graphmem.process.workers import processes

__all__ = ["FRONT_POINTS", "CheckpointChoice", "PolicyPlan", "Sharding", "ShardingOption", "make_policy", "peak_with",
           "policy_job", "search_policy", "units_of"]

FRONT_POINTS = 8  # points of the front analysed by default (each a recording of the whole model)
FRONT_SECONDS = 60  # the solver's time to prove each point of the front (solve.search_front)


def make_policy(job: Job, budget: Budget, *, block_class: str | None = None, base: Prediction | None = None,
                source: ModelSource | None = None, front_points: int = FRONT_POINTS,
                save: Sequence[str] = (), ops: bool = True) -> PolicyPlan:
    """The checkpointing policy of ``job`` with the least recompute that fits ``budget``: see
    search_policy (its arguments); ``ops``: then keep single ops' outputs inside the chosen
    blocks while the budget leaves room (finer.py; each step analysed)."""
    plan, refine = search_policy(job, budget, block_class=block_class, base=base, source=source,
                                 front_points=front_points, save=save)
    return refine(ops, False) if ops else plan


def search_policy(job: Job, budget: Budget, *, block_class: str | None = None, base: Prediction | None = None,
                  source: ModelSource | None = None, front_points: int = FRONT_POINTS,
                  save: Sequence[str] = ()) -> tuple[PolicyPlan, Callable[[bool, bool], PolicyPlan]]:
    """The checkpointing policy of ``job`` with the least recompute that fits ``budget``.

    Args:
        job: a training job (on one device or under ``--parallel fsdp=N``), its model resolved (no
            string), without checkpointing options but ``--checkpoint CLASS`` naming the blocks' class.
        block_class: the class whose modules are the blocks (default: the job's ``--checkpoint``
            class, else the model's outermost repeated block class).
        base: the job's own analysis, when already made.
        front_points: points of the front to analyse (the chosen and the lowest always are).
        save: ``--checkpoint-save`` names (``matmuls``, ``attention``, aten ops): each block may
            also be checkpointed selectively, keeping those ops' outputs (a third variant).

    Returns:
        The PolicyPlan of the blocks (bytes; peaks analysed), and a function that gives it with
        single ops' outputs kept inside the chosen blocks where the budget leaves room.

    Raises:
        UserInputError: the job is no training step, or its model has no blocks.
        UnsupportedError: ``--parallel`` other than ``fsdp=N``.
        UnsupportedError: the recordings do not line up (composite.py).
    """
    source = source if source is not None else job.model.target  # type: ignore[assignment]
    if source is None or isinstance(source, str):
        raise AssertionError(f"make_policy: the job's model must be resolved, got {source!r}")
    model = build_model(source, job.model.kwargs, job.model.hf_config, device=job.device)
    cls, paths = _blocks(job, model, block_class)
    units_are_blocks = job.parallel is not None and units_of(model, job) == (cls,)
    _check_save(save)
    choices = Choices(policy_job(job)[0], cls, tuple(save))
    with progress.labelled("checkpointing policy"):
        base = base or analyse(choices.job)
        recorded, done = _recordings(choices, len(paths), _uses_cache(model), base)
        costs = cost_model(job.device, job.target.gpu)
        composite = _composite(recorded, paths, choices.variants, costs)
        found = search_front(composite, seconds=FRONT_SECONDS)
        front = list(found.points) or [tuple([0] * len(paths))]
        verify = Verifier(choices, composite, budget, base, done, costs)
        made = _answer(verify, front, cls, paths, front_points, _is_transformers(model), len(recorded))
    stopped = () if found.complete else (
        f"the solver stopped after {FRONT_SECONDS} s looking for a peak below the front's last point (a lower one "
        "may exist; the choices shown are analysed)",)
    plan = replace(made, save=choices.save, saved_ops=saved_op_names(choices.save), notes=made.notes + stopped,
                   cost_model=costs.describe(), cost_unit=costs.unit)

    def refine(ops: bool = True, keep: bool = False) -> PolicyPlan:
        return refined(plan, verify, paths, units_are_blocks, ops, keep)

    return plan, refine


def peak_with(job: Job, plan: PolicyPlan, made: CheckpointChoice) -> int:
    """The analysed peak of ``job`` (a training job, its model resolved, without checkpointing
    options but ``--checkpoint CLASS``) with ``made``'s blocks checkpointed as ``plan`` has them."""
    choices = Choices(policy_job(job)[0], plan.block_class, plan.save)
    return analyse(choices.job_of(choice_of(made, len(plan.block_paths)), dict(made.kept))).peak_bytes


def policy_job(job: Job) -> tuple[Job, str | None]:
    """``job`` without checkpointing, and the blocks' class its ``--checkpoint`` names (None: none).

    Raises:
        UserInputError: no training step, or checkpointing options beyond one class.
        UnsupportedError: ``--parallel`` other than ``fsdp=N`` alone.
    """
    if job.mode != "train" or job.generate is not None:
        raise UserInputError(f"--policy chooses activation checkpointing for training: use {spelling('mode')} train")
    parallel = job.parallel
    if parallel is not None and ({name for name, _ in parallel.degrees} != {"fsdp"} or parallel.parallelize):
        raise UnsupportedError(f"--policy with {spelling('parallel')} {parallel.text}: only fsdp=N alone (FSDP2, "
                               "graphmem's "
                               f"own sharding) is searched; analyse other layouts with {spelling('checkpoint_blocks')}")
    checkpoint = job.step.checkpoint
    if checkpoint is not None and (not isinstance(checkpoint, EveryBlock) or checkpoint.every != 1
                                   or len(checkpoint.classes) > 1):
        raise UserInputError(f"--policy chooses the blocks to checkpoint: give at most {spelling('checkpoint')} "
                             "CLASS (the "
                             f"blocks' class), not {spelling('checkpoint_every')}, {spelling('checkpoint_blocks')} "
                             f"or {spelling('checkpoint_save')}")
    return replace(job, step=replace(job.step, checkpoint=None)), (checkpoint.classes[0] if checkpoint else None)


def _blocks(job: Job, model: nn.Module, block_class: str | None) -> tuple[str, tuple[str, ...]]:
    """The blocks' class (``block_class``, else the job's ``--checkpoint`` class, else the model's
    outermost repeated block class) and their module paths, in the model's order."""
    job, named = policy_job(job)
    cls = block_class or named or _outermost(model)
    paths = tuple(name for name, m in model.named_modules()
                  if cls in {type(m).__name__, *(b.__name__ for b in type(m).__bases__)})
    if not paths:
        raise UserInputError(f"--policy: no module of class {cls} in the model")
    return cls, paths


def _outermost(model: nn.Module) -> str:
    from graphmem.preflight.model_facts import block_classes

    classes = block_classes(model)
    if not classes:
        raise UserInputError("--policy: the model has no repeated blocks to checkpoint (no class with two or "
                             f"more modules that have children); name one with {spelling('checkpoint')} CLASS")
    return classes[0]


def _is_transformers(model: nn.Module) -> bool:
    """A transformers PreTrainedModel (by its class's module, so transformers need not be imported)."""
    return any(base.__module__.startswith("transformers.") and base.__name__ == "PreTrainedModel"
               for base in type(model).__mro__)


def _uses_cache(model: nn.Module) -> bool:
    """A transformers model whose config keeps a KV cache in training: checkpointing turns it off
    (graphmem.trace.step.checkpointing, as transformers does), so the recordings do too."""
    return bool(getattr(getattr(model, "config", None), "use_cache", False))


def _uncached(job: Job) -> Job:
    """``job`` with its model's ``config.use_cache`` off, as checkpointing any block sets it."""
    source, kwargs, hf_config, device = job.model.target, job.model.kwargs, job.model.hf_config, job.device

    def build() -> nn.Module:
        model = (copy.deepcopy(source) if isinstance(source, nn.Module)
                 else build_model(source, kwargs, hf_config, device=device))  # type: ignore[arg-type]
        config: Any = model.config
        config.use_cache = False
        return model

    build.__qualname__ = f"uncached({getattr(source, '__qualname__', type(source).__name__)})"
    return replace(job, model=replace(job.model, target=build, kwargs={}, hf_config=None, hf_config_file=None,
                                      preset=None))


def _check_save(save: Sequence[str]) -> None:
    """Raises UserInputError for a ``--policy-save`` name that is no kept-output choice."""
    bad = [name for name in save if name not in ("matmuls", "attention") and not name.startswith("aten.")]
    if bad:
        raise UserInputError(f"--policy-save: unknown {', '.join(bad)}; expected matmuls, attention or aten op "
                             "names such as aten.mm (the outputs a selectively checkpointed block keeps)")


def saved_op_names(save: Sequence[str]) -> tuple[str, ...]:
    """The aten ops (``aten.mm``, ...) whose outputs ``--checkpoint-save`` names keep."""
    from graphmem.trace.rules import ops

    found = {name for name in save if name.startswith("aten.")}
    if "matmuls" in save:
        found |= {str(packet) for packet in ops.MATMULS}
    if "attention" in save:
        found |= {str(packet) for packet in ops.ATTENTION}
    return tuple(sorted(found))


def _recordings(choices: Choices, n: int, cache: bool, base: Prediction
                ) -> tuple[list[Recorded], dict[tuple[int, ...], Prediction]]:
    """The step with every block alike in each checkpointed variant and with every pair of
    variants alternating (with no block checkpointed: the job itself, its KV cache off where
    checkpointing turns it off); the analyses by choice."""
    patterns = choices.patterns(n)
    jobs = [(choices.job_of(p), f"recording with {choices.label(p)}") for p in patterns]
    if cache:
        jobs.append((_uncached(choices.job), "recording with no block checkpointed and the KV cache off"))
    made = analyse_all(jobs)
    done = dict(zip(patterns, made, strict=False))
    unchecked = made[-1] if cache else base
    recorded = [Recorded(tuple([0] * n), train_of(unchecked))]
    recorded += [Recorded(choice, train_of(m)) for choice, m in done.items()]
    return recorded, {tuple([0] * n): base, **done}


def _rank_mode(mode: Any, rank: int) -> Any:
    """The analysed step of the rank group that holds ``rank`` (``mode`` itself on one device)."""
    return next((group.report for group in mode.ranks if rank in group.ranks), mode)


def _composite(recorded: Sequence[Recorded], paths: tuple[str, ...], variants: int, costs: CostModel) -> Composite:
    """The composite of the recordings; with ``--parallel``, one per distinct rank, merged (the
    peak compared is the rank that needs the most, whichever that is for a choice)."""
    ranks = [group.rank for group in recorded[0].mode.ranks]
    if len(ranks) <= 1:
        return build_composite(recorded, paths, variants, costs)
    return merge_composites([build_composite([Recorded(r.choice, _rank_mode(r.mode, rank)) for r in recorded],
                                             paths, variants, costs) for rank in ranks])


def units_of(model: nn.Module, job: Job) -> tuple[str, ...]:
    """The classes FSDP2 shards as units in ``job`` (graphmem.trace.distributed.fsdp's rule)."""
    from graphmem.trace import fsdp_units

    assert job.parallel is not None, f"units_of: a {spelling('parallel')} job"
    return tuple(fsdp_units(model, job.parallel))


def _chosen(verify: Verifier, front: Sequence[tuple[int, ...]], anyway: Sequence[tuple[int, ...]] = ()
            ) -> CheckpointChoice | None:
    """The first point of the front, by recompute, whose analysed peak fits.  The composite's
    peak passes over the points that cannot fit (what the budget compares is never below the
    tensor bytes, plus on a GPU what lives outside the allocator); the analysis decides for the
    others, in order (on the CPU the first is the answer wherever the composite is exact).

    The analyses run side by side, as many at once as there are cores: ``anyway`` (choices the
    plan analyses whatever the answer: the front's points it shows) with the first of those
    points, then the points in turn, as many at a time as there are cores.  The answer is the
    one analysing them one by one gives."""
    candidates = [c for c in front if verify.budget.fits(verify.composite.peak(c) + verify.outside)]
    extra = [c for c in dict.fromkeys(anyway) if c not in verify.done]
    width = processes()
    start = 0
    while start < len(candidates):
        take = max(1, -len(extra) % width) if extra else width  # new analyses that fill the round's cores
        stop = start
        while stop < len(candidates) and take:  # points analysed already cost nothing
            take -= candidates[stop] not in verify.done and candidates[stop] not in extra
            stop += 1
        verify.analyse([*candidates[start:stop], *extra])
        extra = []
        made = next((m for m in map(verify.choice, candidates[start:stop]) if m.fits), None)
        if made is not None:
            return made
        start = stop
    # on a GPU the allocator's blocks, which the composite does not know, can put a choice it
    # ranks higher (a recording: every block checkpointed) under the budget; on the CPU, where
    # the composite is exact, none of these fits either
    verify.analyse(extra)
    fitting = [made for made in _analysed(verify) if made.fits]
    return min(fitting, key=lambda made: (made.recompute_cost, made.peak_bytes), default=None)


def _analysed(verify: Verifier) -> list[CheckpointChoice]:
    """Every choice analysed so far (the recordings among them)."""
    return [verify.choice(choice) for choice in list(verify.done)]


def _lowest(verify: Verifier, last: tuple[int, ...]) -> CheckpointChoice:
    """The lowest analysed peak: the front's last point (``last``), unless a choice analysed
    anyway is lower (on a GPU, by the allocator's blocks: the composite ranks tensor bytes)."""
    verify.analyse([last])
    return min(_analysed(verify), key=lambda made: (made.peak_bytes, made.recompute_cost,
                                                     choice_of(made, len(last)) != last))


def _spread(front: Sequence[tuple[int, ...]], most: int, keep: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """At most ``most`` points of ``front`` (and those of ``keep``), evenly spread, in its order."""
    if len(front) <= most:
        return list(front)
    step = (len(front) - 1) / max(most - 1, 1)
    picked = {front[round(k * step)] for k in range(most)} | set(keep)
    return [c for c in front if c in picked]


def _answer(verify: Verifier, front: list[tuple[int, ...]], cls: str, paths: tuple[str, ...], points: int,
            transformers: bool, recordings: int) -> PolicyPlan:
    n = len(paths)
    # the front's points shown, and its last (the lowest peak), are analysed whatever the answer:
    # side by side with the first points tried
    anyway = _spread(front, points, [front[-1]])
    chosen = _chosen(verify, front, anyway)
    lowest = _lowest(verify, front[-1])
    keep = [front[-1], *([choice_of(chosen, n)] if chosen else [])]
    shown = _spread(front, points, keep)
    verify.analyse(shown)
    return PolicyPlan(block_class=cls, block_paths=paths, budget=verify.budget, chosen=chosen, lowest=lowest,
                      front=tuple(verify.choice(c) for c in shown), front_size=len(front),
                      baseline_bytes=verify.choice(tuple([0] * n)).peak_bytes, exact=verify.composite.exact,
                      notes=verify.composite.notes, transformers=transformers, solver=SOLVER,
                      recordings=recordings, analyses=verify.analyses)
