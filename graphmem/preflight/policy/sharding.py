"""``plan --policy`` under ``--parallel fsdp=N``: FSDP2's units and ``reshard_after_forward`` chosen
with the blocks to checkpoint.

Input: a training ``Job`` whose ``--parallel`` is ``fsdp=N`` alone, a ``Budget``.  Output: the
``PolicyPlan`` of the setting chosen, with ``sharding`` (a frozen ``Sharding``) saying what each
setting costs.

The choice.  FSDP2's ``fully_shard(unit, reshard_after_forward=...)``: True frees a unit's
unsharded parameters after its forward and all-gathers them again in backward; False keeps them
from its forward to its backward: one all-gather of the unit fewer per step, its unsharded
parameters held meanwhile.  Two settings are searched, each with its own checkpointing policy
(the composite built from that setting's per-rank recordings, the answer verified by an analysis
of the job with exactly those settings): FSDP2's default (every unit but the root reshards) and
every unit keeping its parameters.  ``--reshard-after-forward true|false`` given: that one only.

The units.  The job's own (``--fsdp-units``, else its repeated blocks); where no setting fits with
them without recompute, and no ``--fsdp-units`` was given, finer units: the classes of the blocks'
children that hold most of their parameters (a layer's attention and MLP;
graphmem.trace.distributed.fsdp.finer_units), fewer unsharded parameters live at a time.  They are
analysed first with the blocks the job's own units need (their lowest where nothing fits): where
that peak is lower, both settings are searched again with them; where not (on a GPU the caching
allocator's segments can make it higher), the plan says so.  On a tie in recompute and bytes the
job's own units win (fewer collectives).

The objective, in that order: the least recompute that fits, then the fewest bytes all-gathered in
backward.  Recompute first: FSDP2 prefetches the next unit's backward all-gather while the current
one computes (its implicit backward prefetch, torch/distributed/fsdp/_fully_shard/_fsdp_state.py),
so that communication mostly overlaps compute, and a recomputed forward never does.  Each cost is
reported as it is (FLOPs, bytes); neither is converted into the other.  Since the recompute is
least per setting (solve.py) and the communication depends only on the setting, the least over
the settings of (recompute, bytes) is the least over every pair of setting and blocks
(tests/unit/preflight/test_policy_sharding.py checks it against exhaustive search).  Single ops'
outputs are then kept inside the chosen blocks (finer.py) under the setting taken only: that
lowers its recompute and never raises it, so the setting stays the one to take.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from graphmem.job.job import Job
from graphmem.job.load import ModelSource, build_model
from graphmem.job.option import spelling
from graphmem.job.parallel import ParallelSpec
from graphmem.preflight.budget import Budget
from graphmem.preflight.policy.results import PolicyPlan, Sharding, ShardingOption
from graphmem.preflight.policy.search import FRONT_POINTS, peak_with, search_policy, units_of
from graphmem.preflight.search import Prediction
from graphmem.process import progress

__all__ = ["Sharding", "ShardingOption", "choose_setting", "make_sharded_policy"]


def choose_setting(costs: Sequence[tuple[int, int] | None]) -> int | None:
    """The setting to take: of those whose (recompute FLOPs, bytes all-gathered in backward) is
    given (None: nothing fits under it), the least recompute, then the fewest bytes, then the
    first; None when nothing fits under any."""
    fitting = [(cost, index) for index, cost in enumerate(costs) if cost is not None]
    return min(fitting)[1] if fitting else None


def _settings(given: bool | None) -> tuple[bool | None, ...]:
    """The settings searched: the one given, else FSDP2's default and every unit keeping."""
    return (given,) if given is not None else (None, False)


def make_sharded_policy(job: Job, budget: Budget, *, block_class: str | None = None, base: Prediction | None = None,
                        source: ModelSource | None = None, front_points: int = FRONT_POINTS,
                        save: Sequence[str] = (), ops: bool = True) -> PolicyPlan:
    """The checkpointing policy, the FSDP2 units and ``reshard_after_forward`` of ``job``
    (``--parallel fsdp=N``) with the least recompute, then the least backward communication,
    that fits ``budget``.

    Args: as make_policy's (``base``: the analysis of the job as given).

    Returns:
        The PolicyPlan of the setting chosen (the lowest peak's setting when nothing fits), its
        ``sharding`` every setting's costs; every peak analysed.
    """
    spec = job.parallel
    assert spec is not None, f"make_sharded_policy: a {spelling('parallel')} job"
    units, finer = _unit_classes(job, source)
    searched = _searched(job, spec, units, budget, block_class, base, source, front_points, save)
    probed = None
    if finer and not any(s.plan.chosen is not None and s.plan.chosen.recompute_cost == 0 for s in searched):
        # finer units hold fewer unsharded parameters at a time: searched where the blocks' own
        # units need recompute (or fit nowhere) and, with the same blocks checkpointed, the finer
        # units' peak is lower; on a tie the blocks' units (fewer collectives) win
        first = searched[0]
        made = first.plan.chosen or first.plan.lowest
        with progress.labelled(f"units {', '.join(finer)}"):
            peak = peak_with(replace(job, parallel=replace(spec, units=finer, reshard_after_forward=first.setting)),
                             first.plan, made)
            if peak < made.peak_bytes:
                searched += _searched(job, replace(spec, units=finer), finer, budget, block_class, None, source,
                                      front_points, save)
            else:
                probed = (finer, peak, made.peak_bytes)
    options = _options(searched)
    picked = choose_setting([(o.chosen.recompute_cost, o.gathered_bytes) if o.chosen else None for o in options])
    if picked is None:  # nothing fits: the setting with the lowest peak
        picked = min(range(len(options)), key=lambda i: (options[i].lowest.peak_bytes, options[i].gathered_bytes))
    else:  # refined in the setting taken only: single ops' outputs lower its recompute, never raise it, and
        # units that keep their parameters (where the others reshard) its communication
        keep = ops and spec.reshard_after_forward is None and searched[picked].setting is None
        searched[picked] = replace(searched[picked], plan=searched[picked].refine(ops, keep))
        options = _options(searched)
    given = next(s.plan for s in searched if s.setting == spec.reshard_after_forward)
    return replace(searched[picked].plan, baseline_bytes=given.baseline_bytes, sharding=Sharding(
        parallel=spec.text, units=options[picked].units, param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype,
        reshard_after_forward=options[picked].reshard_after_forward, options=tuple(options), probed=probed))


@dataclass(frozen=True, slots=True)
class _Searched:
    """One setting's search: the units, reshard_after_forward, the plan and its refinement."""

    units: tuple[str, ...]
    setting: bool | None
    plan: PolicyPlan
    refine: Callable[[bool, bool], PolicyPlan]


def _searched(job: Job, spec: ParallelSpec, units: tuple[str, ...], budget: Budget, block_class: str | None,
              base: Prediction | None, source: ModelSource | None, front_points: int,
              save: Sequence[str]) -> list[_Searched]:
    """Each reshard_after_forward setting's checkpointing search with FSDP2's units ``units``."""
    found = []
    for setting in _settings(spec.reshard_after_forward):
        label = {None: "parameters resharded after forward", False: "parameters kept after forward",
                 True: "every unit resharded after forward"}[setting]
        with progress.labelled(label):
            plan, refine = search_policy(replace(job, parallel=replace(spec, reshard_after_forward=setting)), budget,
                                         block_class=block_class, source=source, front_points=front_points, save=save,
                                         base=base if setting == spec.reshard_after_forward else None)
        found.append(_Searched(units, setting, plan, refine))
    return found


def _options(searched: Sequence[_Searched]) -> list[ShardingOption]:
    plans = [s.plan for s in searched]
    gathered = [(p.chosen or p.lowest).gathered_bytes for p in plans]
    # FSDP2's default, every unit resharding (before some units were chosen to keep their parameters)
    plain = [(p.per_block or p.chosen or p.lowest).gathered_bytes for p in plans]
    default = next((nbytes for s, nbytes in zip(searched, plain, strict=True) if s.setting is None), max(plain))
    return [ShardingOption(s.setting, s.plan.chosen, s.plan.lowest, nbytes, max(default - nbytes, 0), s.units)
            for s, nbytes in zip(searched, gathered, strict=True)]


def _unit_classes(job: Job, source: ModelSource | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The classes FSDP2 shards as units in this job (graphmem.trace.distributed.fsdp's rule), and
    those that split them finer (its finer_units; none where --fsdp-units names the units)."""
    from graphmem.trace import finer_units

    model = build_model(source if source is not None else job.model.target,  # type: ignore[arg-type]
                        job.model.kwargs, job.model.hf_config, device=job.device)
    units = units_of(model, job)
    assert job.parallel is not None, f"_unit_classes: a {spelling('parallel')} job"
    return units, (() if job.parallel.units else finer_units(model, units))
