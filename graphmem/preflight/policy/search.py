"""``make_policy``: record the step four ways, solve for the least recompute under the budget, and
analyse the job with the chosen blocks checkpointed.

Input: a training ``Job`` on one device or under ``--parallel fsdp=N`` (its model resolved), a
``Budget``, the class of the blocks.  Output: a frozen ``PolicyPlan``.  Every peak it holds comes
from an analysis of the job with that choice applied (``--checkpoint CLASS --checkpoint-blocks
...``, as ``graphmem analyze`` runs it), never from the composite alone; the composite's number is kept beside it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from graphmem import progress
from graphmem.errors import UnsupportedError, UserInputError
from graphmem.job.grammar import format_blocks
from graphmem.job.job import Job
from graphmem.job.load import ModelSource, build_model
from graphmem.memory.results import without_graphs
from graphmem.preflight.budget import Budget
from graphmem.preflight.footprint import footprint_of
from graphmem.preflight.policy.composite import Composite, Recorded, build_composite, merge_composites
from graphmem.preflight.policy.costs import CostModel, cost_model
from graphmem.preflight.policy.finer import Keepable, keepable
from graphmem.preflight.policy.gathers import backward_gather_bytes
from graphmem.preflight.policy.solve import SOLVER, search_front
from graphmem.preflight.search import Prediction, predict
from graphmem.workers import fork_map, processes

__all__ = ["FRONT_POINTS", "CheckpointChoice", "PolicyPlan", "Sharding", "ShardingOption", "make_policy", "peak_with",
           "policy_job", "search_policy", "units_of"]

FRONT_POINTS = 8  # points of the front analysed by default (each a recording of the whole model)
FRONT_SECONDS = 60  # the solver's time to prove each point of the front (solve.search_front)
FINER_ANALYSES = 6  # analyses the op-by-op refinement of the chosen blocks may make (finer.py)


@dataclass(frozen=True, slots=True)
class CheckpointChoice:
    """One per-block choice, analysed.

    Attributes:
        blocks: the checkpointed blocks (0-based, among the modules of the class in the model's
            order), as ``--checkpoint-blocks`` takes them.
        selective: those of them that keep the outputs of the plan's ``save`` ops (selective
            checkpointing), as ``--checkpoint-save-blocks`` takes them; the others are whole.
        peak_bytes: the analysed peak, what the budget compares (graphmem/preflight/footprint.py).
        predicted_bytes: the composite's peak for it (tensor bytes), before the analysis.
        recompute_flops: FLOPs the analysis recomputed (both recorded iterations).
        extra_compute: recompute_flops over the job's own FLOPs (0.25: a quarter more).
        fits: peak_bytes fits the budget.
        gathered_bytes: with ``--parallel fsdp=N``, the bytes one rank all-gathers in backward
            per step (the analysis's; 0 without FSDP2).
        kept: blocks that keep outputs op by op (finer.py), each with every output it keeps
            (``--checkpoint-save`` names: ``attn.proj:matmuls``), as ``--checkpoint-save-in``
            takes them; they are not in ``selective``.
        keep_units: with ``--parallel fsdp=N``, FSDP2 units (the blocks) that keep their
            parameters after forward where the setting reshards the others (--fsdp-keep-units).
        recompute_cost: the recompute by the plan's cost model (costs.py), what it minimises:
            FLOPs, or on a GPU with known peak rates a roofline time in nanoseconds.
    """

    blocks: tuple[int, ...]
    selective: tuple[int, ...]
    peak_bytes: int
    predicted_bytes: int
    recompute_flops: int
    extra_compute: float
    fits: bool
    gathered_bytes: int = 0
    kept: tuple[tuple[int, tuple[str, ...]], ...] = ()
    keep_units: tuple[int, ...] = ()
    recompute_cost: int = 0


@dataclass(frozen=True, slots=True)
class ShardingOption:
    """One ``reshard_after_forward`` setting with its own checkpointing policy, analysed.

    Attributes:
        reshard_after_forward: fully_shard's argument for every unit (None: FSDP2's default,
            every unit but the root reshards).
        chosen: the least recompute that fits under this setting (None: none fits).
        lowest: the lowest peak any checkpointing choice reaches under it.
        gathered_bytes: bytes one rank all-gathers in backward per step, with ``chosen`` (else
            ``lowest``); ``saved_bytes``: fewer than FSDP2's default setting gathers.
        units: the classes sharded as FSDP2 units under this setting.
    """

    reshard_after_forward: bool | None
    chosen: CheckpointChoice | None
    lowest: CheckpointChoice
    gathered_bytes: int
    saved_bytes: int
    units: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Sharding:
    """FSDP2's settings of the plan: the strategy (``fsdp=8``), the classes sharded as units, the
    MixedPrecisionPolicy dtypes, the setting chosen and every setting searched."""

    parallel: str
    units: tuple[str, ...]
    param_dtype: str | None
    reduce_dtype: str | None
    reshard_after_forward: bool | None
    options: tuple[ShardingOption, ...]
    # finer units tried with the job's own units' blocks checkpointed and found no lower: those
    # units, their analysed peak and the job's own (not searched further)
    probed: tuple[tuple[str, ...], int, int] | None = None

    @property
    def finer(self) -> bool:
        """The units chosen split the job's own (the first searched) finer."""
        return bool(self.options) and bool(self.options[0].units) and self.units != self.options[0].units

    def taken(self, option: ShardingOption) -> bool:
        """Whether ``option`` is the setting chosen."""
        return option.reshard_after_forward == self.reshard_after_forward and (option.units or self.units) == self.units


@dataclass(frozen=True, slots=True)
class PolicyPlan:
    """``plan --policy``'s answer.

    Attributes:
        block_class: the class whose modules are the blocks.
        block_paths: the blocks' module paths, in the model's order.
        chosen: the least recompute whose analysed peak fits; None when none fits.
        lowest: the lowest peak any choice reaches (analysed), the least recompute among equals.
        front: analysed points of the front (no other choice has both less recompute and a lower
            peak), the fewest recompute first; ``front_size``: the front's points in all.
        baseline_bytes: the job as given (no block checkpointed).
        exact: the composite was exact by its own checks (composite.py); ``notes`` say where not.
        transformers: the model is a transformers PreTrainedModel (the emitted file says how to
            turn its own checkpointing on for these layers).
        recordings: analyses the composite read; ``analyses``: analyses that verified choices.
        save: with ``--policy-save``, the outputs a block may keep (``--checkpoint-save``'s names),
            so each block is kept, checkpointed whole or checkpointed keeping them; ``saved_ops``:
            the aten ops they name.
        sharding: with ``--parallel fsdp=N``, FSDP2's settings searched with the blocks and the
            one chosen (graphmem.preflight.policy.sharding); None on one device.
        per_block: where ``chosen`` keeps single ops' outputs (its ``kept``) or some FSDP2 units
            their parameters (``keep_units``), the per-block answer it started from (a point of
            the front); None otherwise.
        cost_model / cost_unit: what "recompute" means in the search (costs.py), in words, and
            the unit of each choice's ``recompute_cost`` (``FLOPs`` or ``ns``).
    """

    block_class: str
    block_paths: tuple[str, ...]
    budget: Budget
    chosen: CheckpointChoice | None
    lowest: CheckpointChoice
    front: tuple[CheckpointChoice, ...]
    front_size: int
    baseline_bytes: int
    exact: bool
    notes: tuple[str, ...]
    transformers: bool
    solver: str
    recordings: int
    analyses: int
    save: tuple[str, ...] = ()
    saved_ops: tuple[str, ...] = ()
    sharding: Sharding | None = None
    per_block: CheckpointChoice | None = None
    cost_model: str = "FLOPs (torch.utils.flop_counter's formulas)"
    cost_unit: str = "FLOPs"

    @property
    def blocks(self) -> int:
        return len(self.block_paths)


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
    source = source if source is not None else job.model  # type: ignore[assignment]
    if source is None or isinstance(source, str):
        raise AssertionError(f"make_policy: the job's model must be resolved, got {source!r}")
    model = build_model(source, job.model_kwargs, job.hf_config, device=job.device)
    cls, paths = _blocks(job, model, block_class)
    units_are_blocks = job.parallel is not None and units_of(model, job) == (cls,)
    _check_save(save)
    choices = _Choices(policy_job(job)[0], cls, tuple(save))
    with progress.labelled("checkpointing policy"):
        base = base or _analyse(choices.job)
        recorded, done = _recordings(choices, len(paths), _uses_cache(model), base)
        costs = cost_model(job.device, job.gpu)
        composite = _composite(recorded, paths, choices.variants, costs)
        found = search_front(composite, seconds=FRONT_SECONDS)
        front = list(found.points) or [tuple([0] * len(paths))]
        verify = _Verifier(choices, composite, budget, base, done, costs)
        made = _answer(verify, front, cls, paths, front_points, _is_transformers(model), len(recorded))
    stopped = () if found.complete else (
        f"the solver stopped after {FRONT_SECONDS} s looking for a peak below the front's last point (a lower one "
        "may exist; the choices shown are analysed)",)
    plan = replace(made, save=choices.save, saved_ops=saved_op_names(choices.save), notes=made.notes + stopped,
                   cost_model=costs.describe(), cost_unit=costs.unit)

    def refine(ops: bool = True, keep: bool = False) -> PolicyPlan:
        chosen = plan.chosen
        if chosen is None:
            return plan
        finer = chosen
        if ops and chosen.blocks:
            with progress.labelled("keeping single ops' outputs"):
                finer = _finer(verify, paths, finer)
        if keep and units_are_blocks:
            with progress.labelled("keeping some units' parameters"):
                finer = _keep_units(verify, len(paths), finer)
        if finer == chosen:
            return plan
        return replace(plan, chosen=finer, per_block=chosen, analyses=verify.analyses)

    return plan, refine


def peak_with(job: Job, plan: PolicyPlan, made: CheckpointChoice) -> int:
    """The analysed peak of ``job`` (a training job, its model resolved, without checkpointing
    options but ``--checkpoint CLASS``) with ``made``'s blocks checkpointed as ``plan`` has them."""
    choices = _Choices(policy_job(job)[0], plan.block_class, plan.save)
    return _analyse(choices.job_of(_choice_of(made, len(plan.block_paths)), dict(made.kept))).peak_bytes


def policy_job(job: Job) -> tuple[Job, str | None]:
    """``job`` without checkpointing, and the blocks' class its ``--checkpoint`` names (None: none).

    Raises:
        UserInputError: no training step, or checkpointing options beyond one class.
        UnsupportedError: ``--parallel`` other than ``fsdp=N`` alone.
    """
    if job.mode != "train" or job.generate is not None:
        raise UserInputError("--policy chooses activation checkpointing for training: use --mode train")
    parallel = job.parallel
    if parallel is not None and ({name for name, _ in parallel.degrees} != {"fsdp"} or parallel.parallelize):
        raise UnsupportedError(f"--policy with --parallel {parallel.text}: only fsdp=N alone (FSDP2, graphmem's "
                               "own sharding) is searched; analyse other layouts with --checkpoint-blocks")
    step = job.step
    if step.checkpoint_every != 1 or step.checkpoint_save or step.checkpoint_blocks or len(step.checkpoint) > 1:
        raise UserInputError("--policy chooses the blocks to checkpoint: give at most --checkpoint CLASS (the "
                             "blocks' class), not --checkpoint-every, --checkpoint-blocks or --checkpoint-save")
    return job.updated(checkpoint=[]), (step.checkpoint[0] if step.checkpoint else None)


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
                             "more modules that have children); name one with --checkpoint CLASS")
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
    source, kwargs, hf_config, device = job.model, job.model_kwargs, job.hf_config, job.device

    def build() -> nn.Module:
        model = (copy.deepcopy(source) if isinstance(source, nn.Module)
                 else build_model(source, kwargs, hf_config, device=device))  # type: ignore[arg-type]
        config: Any = model.config
        config.use_cache = False
        return model

    build.__qualname__ = f"uncached({getattr(source, '__qualname__', type(source).__name__)})"
    return job.updated(model=build, model_kwargs={}, hf_config=None, preset=None)


@dataclass(frozen=True, slots=True)
class _Choices:
    """How a choice (each block's variant: 0 kept, 1 checkpointed whole, 2 checkpointed keeping
    the ``save`` outputs) becomes a job."""

    job: Job  # without checkpointing
    cls: str
    save: tuple[str, ...]

    @property
    def variants(self) -> int:
        return 3 if self.save else 2

    def job_of(self, choice: Sequence[int], kept: Mapping[int, tuple[str, ...]] | None = None,
               keep_units: tuple[int, ...] = ()) -> Job:
        """The job with ``choice`` applied, as --checkpoint-blocks (--checkpoint-save-blocks) say;
        ``kept``: blocks that keep these outputs instead (--checkpoint-save-in); ``keep_units``:
        FSDP2 units that keep their parameters after forward (--fsdp-keep-units)."""
        job = self.job
        if keep_units:
            assert job.parallel is not None, "job_of: units to keep under --parallel fsdp=N"
            job = replace(job, parallel=replace(job.parallel, keep_units=keep_units))
        blocks = [i for i, v in enumerate(choice) if v]
        if not blocks:
            return job
        own = dict(kept or {})
        selective = [i for i, v in enumerate(choice) if v == 2 and i not in own]
        extra: dict[str, Any] = {"checkpoint_save_in": own} if own else {}
        alike = not own and len(set(choice)) == 1  # every block in one variant
        if alike or (not own and choice == tuple(1 - i % 2 for i in range(len(choice)))):
            # said without block indices (every block, or every second from the first), the same
            # step is recorded with the model's repeated blocks recorded once (graphmem.trace.repeat)
            save = {"checkpoint_save": list(self.save)} if choice[0] == 2 else {}
            return job.updated(checkpoint=[self.cls], checkpoint_every=1 if alike else 2, **save)
        if not selective:
            return job.updated(checkpoint=[self.cls], checkpoint_blocks=blocks, **extra)
        return job.updated(checkpoint=[self.cls], checkpoint_blocks=blocks, checkpoint_save=list(self.save),
                           checkpoint_save_blocks=selective, **extra)

    def names_of(self, choice: Sequence[int], block: int) -> tuple[str, ...]:
        """The outputs ``block`` keeps in ``choice`` (the ``save`` names where selective)."""
        return self.save if choice[block] == 2 else ()

    def label(self, choice: Sequence[int]) -> str:
        whole = format_blocks([i for i, v in enumerate(choice) if v == 1]) or "none"
        kept = format_blocks([i for i, v in enumerate(choice) if v == 2])
        return f"blocks {whole} checkpointed" + (f", {kept} keeping {', '.join(self.save)}" if kept else "")

    def patterns(self, n: int) -> list[tuple[int, ...]]:
        """Every block alike in each checkpointed variant, and every ordered pair of variants
        alternating (a on even blocks, b on odd): each pair of neighbours both ways."""
        alike = [tuple([v] * n) for v in range(1, self.variants)]
        pairs = [tuple(a if i % 2 == 0 else b for i in range(n))
                 for a in range(self.variants) for b in range(self.variants) if a != b]
        return [p for p in dict.fromkeys([*alike, *pairs]) if any(p)]


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


def _analyse(job: Job) -> Prediction:
    made = predict(job, checkpoint_comparison=False)
    return Prediction(made.peak_bytes, without_graphs(made.report))


def _analyse_in_worker(item: tuple[Job, str, int]) -> Prediction:
    job, label, parent = item
    if os.getpid() != parent:
        progress.mute()
    with progress.labelled(label):
        return _analyse(job)


def _analyse_all(jobs: Sequence[tuple[Job, str]]) -> list[Prediction]:
    """Each job analysed, side by side in worker processes where there are cores."""
    return fork_map(_analyse_in_worker, [(job, label, os.getpid()) for job, label in jobs],
                    what="analysing a checkpointing choice")


def _recordings(choices: _Choices, n: int, cache: bool, base: Prediction
                ) -> tuple[list[Recorded], dict[tuple[int, ...], Prediction]]:
    """The step with every block alike in each checkpointed variant and with every pair of
    variants alternating (with no block checkpointed: the job itself, its KV cache off where
    checkpointing turns it off); the analyses by choice."""
    patterns = choices.patterns(n)
    jobs = [(choices.job_of(p), f"recording with {choices.label(p)}") for p in patterns]
    if cache:
        jobs.append((_uncached(choices.job), "recording with no block checkpointed and the KV cache off"))
    made = _analyse_all(jobs)
    done = dict(zip(patterns, made, strict=False))
    unchecked = made[-1] if cache else base
    recorded = [Recorded(tuple([0] * n), _train(unchecked))]
    recorded += [Recorded(choice, _train(m)) for choice, m in done.items()]
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


def _train(prediction: Prediction) -> Any:
    mode = prediction.report.train
    assert mode is not None, "make_policy: a training analysis"
    return mode


class _Verifier:
    """Analyses choices (each once) and turns them into CheckpointChoices."""

    def __init__(self, choices: _Choices, composite: Composite, budget: Budget, base: Prediction,
                 done: Mapping[tuple[int, ...], Prediction], costs: CostModel) -> None:
        self.choices, self.composite, self.budget, self.costs = choices, composite, budget, costs
        self.flops = _train(base).flops
        # on a GPU, what the budget compares besides the tensors: the CUDA context, NCCL's buffers
        self.outside = footprint_of(base.report, "train").outside_bytes
        self.done: dict[tuple[int, ...], Prediction] = dict(done)
        self.finer: dict[tuple[tuple[int, ...], Any], Prediction] = {}
        self.made: dict[tuple[tuple[int, ...], Any, tuple[int, ...]], CheckpointChoice] = {}
        self.analyses = 0  # made here, to verify


    def analyse(self, choices: Sequence[tuple[int, ...]]) -> None:
        todo = [c for c in dict.fromkeys(choices) if c not in self.done]
        jobs = [(self.choices.job_of(c), f"analysing {self.choices.label(c)}") for c in todo]
        self.done.update(zip(todo, _analyse_all(jobs), strict=True))
        self.analyses += len(todo)

    def choice(self, choice: tuple[int, ...]) -> CheckpointChoice:
        self.analyse([choice])
        return self._made(choice, self.done[choice], {})

    def kept_choice(self, choice: tuple[int, ...], kept: Mapping[int, tuple[str, ...]],
                    keep_units: tuple[int, ...] = ()) -> CheckpointChoice:
        """``choice`` with the blocks of ``kept`` keeping those outputs (and the FSDP2 units of
        ``keep_units`` their parameters), analysed."""
        self.analyse_kept(choice, [(kept, keep_units)])
        return self._made(choice, self.finer[choice, _kept_key(kept, keep_units)], kept, keep_units)

    def analyse_kept(self, choice: tuple[int, ...],
                     trials: Sequence[tuple[Mapping[int, tuple[str, ...]], tuple[int, ...]]]) -> None:
        """kept_choice's analyses of ``choice`` with each (kept, keep_units) of ``trials``, side by side."""
        todo = {_kept_key(kept, units): (kept, units) for kept, units in trials
                if (choice, _kept_key(kept, units)) not in self.finer}
        jobs = [(self.choices.job_of(choice, kept, units), f"analysing {self.choices.label(choice)} with "
                 + ("outputs kept" if not units else "parameters kept in some units")) for kept, units in todo.values()]
        self.finer.update({(choice, key): made for key, made in zip(todo, _analyse_all(jobs), strict=True)})
        self.analyses += len(todo)

    def _made(self, choice: tuple[int, ...], made: Prediction, kept: Mapping[int, tuple[str, ...]],
              keep_units: tuple[int, ...] = ()) -> CheckpointChoice:
        """The CheckpointChoice of an analysis, made once (its recompute cost reads the whole trace)."""
        key = (choice, tuple(sorted(kept.items())), keep_units)
        if key not in self.made:
            self.made[key] = self._checkpoint_choice(choice, made, kept, keep_units)
        return self.made[key]

    def _checkpoint_choice(self, choice: tuple[int, ...], made: Prediction, kept: Mapping[int, tuple[str, ...]],
                           keep_units: tuple[int, ...]) -> CheckpointChoice:
        recompute = _train(made).recompute_flops
        return CheckpointChoice(blocks=_blocks_of(choice),
                                selective=tuple(i for i, v in enumerate(choice) if v == 2 and i not in kept),
                                peak_bytes=made.peak_bytes,
                                predicted_bytes=self.composite.peak(choice), recompute_flops=recompute,
                                extra_compute=recompute / self.flops if self.flops else 0.0,
                                fits=self.budget.fits(made.peak_bytes),
                                gathered_bytes=backward_gather_bytes(_train(made)),
                                kept=tuple(sorted(kept.items())), keep_units=keep_units,
                                recompute_cost=self.costs.recompute(_train(made)))


def _kept_key(kept: Mapping[int, tuple[str, ...]], keep_units: tuple[int, ...]) -> Any:
    return tuple(sorted(kept.items())), keep_units


class _Paid:
    """The greedy steps' analyses of ``choice`` with outputs or units kept: each step's own, and
    with cores to spare the one the step after a failure needs, side by side.  A step costs one
    analysis where its choice was not analysed before or only ahead (as one after another would)."""

    def __init__(self, verify: _Verifier, choice: tuple[int, ...]) -> None:
        self.verify, self.choice = verify, choice
        self.ahead: set[Any] = set()  # analysed ahead, not yet a step's

    def costs(self, kept: Mapping[int, tuple[str, ...]], units: tuple[int, ...]) -> bool:
        key = (self.choice, _kept_key(kept, units))
        new = key not in self.verify.finer or key in self.ahead
        self.ahead.discard(key)
        return new

    def analyse(self, now: tuple[Mapping[int, tuple[str, ...]], tuple[int, ...]],
                ahead: Sequence[tuple[Mapping[int, tuple[str, ...]], tuple[int, ...]]]) -> None:
        ahead = list(ahead) if processes() > 1 else []
        self.ahead.update((self.choice, _kept_key(kept, units)) for kept, units in ahead
                          if (self.choice, _kept_key(kept, units)) not in self.verify.finer)
        self.verify.analyse_kept(self.choice, [now, *ahead])


@dataclass(frozen=True, slots=True)
class _Step:
    """Where _finer's greedy stands: the item name it tries (``group``), its blocks not keeping it
    yet (``members``), how many of them the next analysis takes, the outputs kept so far (``own``)
    and the best choice found."""

    group: int
    members: tuple[Keepable, ...]
    count: int
    own: Mapping[int, tuple[str, ...]]
    chosen: CheckpointChoice


def _finer(verify: _Verifier, paths: Sequence[str], chosen: CheckpointChoice) -> CheckpointChoice:
    """``chosen`` with single ops' outputs kept in its checkpointed blocks (finer.py): items of
    the same name (``attn.proj:matmuls``), the most FLOPs per byte first, in as many blocks as
    the room left holds (the earliest first), then in half as many while an analysis says the
    step no longer fits or recomputes no less; at most FINER_ANALYSES steps that analyse.  With
    cores to spare, the step after a failure is analysed beside each step (the same answer)."""
    choice = _choice_of(chosen, len(paths))
    groups: dict[str, list[Keepable]] = {}
    mode = _train(verify.done[choice])
    for item in keepable(mode, paths, choice, verify.costs.op_costs(mode)):
        groups.setdefault(item.name, []).append(item)
    names = list(groups)

    def room(made: CheckpointChoice, group: int, members: Sequence[Keepable]) -> int:
        size = max(max(m.nbytes for m in groups[names[group]]), 1)
        return min(len(members), (verify.budget.cap_bytes - made.peak_bytes) // size)

    def settled(step: _Step) -> _Step | None:
        """``step``, or the first name after it with blocks to try; None when none is left."""
        while step.count < 1:
            if step.group + 1 >= len(names):
                return None
            members = tuple(sorted(groups[names[step.group + 1]], key=lambda m: m.block))
            step = replace(step, group=step.group + 1, members=members, count=room(step.chosen, step.group + 1,
                                                                                     members))
        return step

    def trial(step: _Step) -> dict[int, tuple[str, ...]]:
        own = dict(step.own)
        for member in step.members[:step.count]:
            own[member.block] = (*own.get(member.block, verify.choices.names_of(choice, member.block)),
                                 names[step.group])
        return own

    step = settled(_Step(-1, (), 0, {}, chosen))
    paid = _Paid(verify, choice)
    tried = 0
    while step is not None and tried < FINER_ANALYSES:
        now, otherwise = trial(step), settled(replace(step, count=step.count // 2))
        tried += paid.costs(now, ())
        paid.analyse((now, ()), [(trial(otherwise), ())] if otherwise is not None else [])
        made = verify.kept_choice(choice, now)
        if made.fits and made.recompute_cost < step.chosen.recompute_cost:
            rest = step.members[step.count:]
            step = settled(replace(step, own=now, chosen=made, members=rest, count=room(made, step.group, rest)))
            chosen = made
        else:
            step = otherwise
    return chosen


def _keep_units(verify: _Verifier, n: int, chosen: CheckpointChoice) -> CheckpointChoice:
    """``chosen`` (its FSDP2 units resharding after forward) with the last units keeping their
    parameters instead, as many as the room left holds by the bytes each all-gathers again in
    backward, fewer (halved) while an analysis says the step no longer fits; then more while it
    fits; each kept unit all-gathers its parameters once per step instead of twice.  At most
    FINER_ANALYSES steps that analyse; with cores to spare, the step after a failure is analysed
    beside each step (the same answer)."""
    size = chosen.gathered_bytes // n if n else 0
    if size <= 0:
        return chosen
    choice = _choice_of(chosen, n)
    kept = dict(chosen.kept)
    count = min(n, (verify.budget.cap_bytes - chosen.peak_bytes) // size)
    failed = n + 1  # the fewest units found not to fit

    def units(count: int) -> tuple[int, ...]:
        return tuple(range(n - count, n))

    def tried(count: int, failed: int, chosen: CheckpointChoice) -> bool:
        return 1 <= count < failed and count > len(chosen.keep_units)

    paid = _Paid(verify, choice)
    steps = 0
    while steps < FINER_ANALYSES and tried(count, failed, chosen):
        otherwise = (len(chosen.keep_units) + count) // 2
        steps += paid.costs(kept, units(count))
        paid.analyse((kept, units(count)), [(kept, units(otherwise))] if tried(otherwise, count, chosen) else [])
        made = verify.kept_choice(choice, kept, units(count))
        if made.fits and made.gathered_bytes < chosen.gathered_bytes:
            chosen = made
            count = min(n, count + (verify.budget.cap_bytes - made.peak_bytes) // size)
        else:
            failed, count = count, otherwise
    return chosen


def units_of(model: nn.Module, job: Job) -> tuple[str, ...]:
    """The classes FSDP2 shards as units in ``job`` (graphmem.trace.distributed.fsdp's rule)."""
    from graphmem.trace import fsdp_units

    assert job.parallel is not None, "units_of: a --parallel job"
    return tuple(fsdp_units(model, job.parallel))


def _blocks_of(choice: Sequence[int]) -> tuple[int, ...]:
    return tuple(i for i, v in enumerate(choice) if v)


def _choice_of(made: CheckpointChoice, n: int) -> tuple[int, ...]:
    return tuple(2 if i in made.selective else int(i in made.blocks) for i in range(n))


def _chosen(verify: _Verifier, front: Sequence[tuple[int, ...]], anyway: Sequence[tuple[int, ...]] = ()
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


def _analysed(verify: _Verifier) -> list[CheckpointChoice]:
    """Every choice analysed so far (the recordings among them)."""
    return [verify.choice(choice) for choice in list(verify.done)]


def _lowest(verify: _Verifier, last: tuple[int, ...]) -> CheckpointChoice:
    """The lowest analysed peak: the front's last point (``last``), unless a choice analysed
    anyway is lower (on a GPU, by the allocator's blocks: the composite ranks tensor bytes)."""
    verify.analyse([last])
    return min(_analysed(verify), key=lambda made: (made.peak_bytes, made.recompute_cost,
                                                     _choice_of(made, len(last)) != last))


def _spread(front: Sequence[tuple[int, ...]], most: int, keep: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """At most ``most`` points of ``front`` (and those of ``keep``), evenly spread, in its order."""
    if len(front) <= most:
        return list(front)
    step = (len(front) - 1) / max(most - 1, 1)
    picked = {front[round(k * step)] for k in range(most)} | set(keep)
    return [c for c in front if c in picked]


def _answer(verify: _Verifier, front: list[tuple[int, ...]], cls: str, paths: tuple[str, ...], points: int,
            transformers: bool, recordings: int) -> PolicyPlan:
    n = len(paths)
    # the front's points shown, and its last (the lowest peak), are analysed whatever the answer:
    # side by side with the first points tried
    anyway = _spread(front, points, [front[-1]])
    chosen = _chosen(verify, front, anyway)
    lowest = _lowest(verify, front[-1])
    keep = [front[-1], *([_choice_of(chosen, n)] if chosen else [])]
    shown = _spread(front, points, keep)
    verify.analyse(shown)
    return PolicyPlan(block_class=cls, block_paths=paths, budget=verify.budget, chosen=chosen, lowest=lowest,
                      front=tuple(verify.choice(c) for c in shown), front_size=len(front),
                      baseline_bytes=verify.choice(tuple([0] * n)).peak_bytes, exact=verify.composite.exact,
                      notes=verify.composite.notes, transformers=transformers, solver=SOLVER,
                      recordings=recordings, analyses=verify.analyses)
