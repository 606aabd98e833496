"""Refinement: the chosen per-block choice with single ops' outputs kept inside its checkpointed
blocks (finer.py's items), and under ``--parallel fsdp=N`` some FSDP2 units keeping their
parameters, greedily while the budget leaves room, each step analysed.

Input: the plan, its verifier (verify.py) and the blocks' paths.  Output: the plan with the
refined choice (its per-block answer kept beside it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from graphmem.preflight.policy.finer import Keepable, keepable
from graphmem.preflight.policy.results import CheckpointChoice, PolicyPlan
from graphmem.preflight.policy.verify import Verifier, choice_of, kept_key, train_of
from graphmem.process import progress
from graphmem.process.workers import processes

__all__ = ["FINER_ANALYSES", "refined"]

FINER_ANALYSES = 6  # analyses the op-by-op refinement of the chosen blocks may make (finer.py)


def refined(plan: PolicyPlan, verify: Verifier, paths: Sequence[str], units_are_blocks: bool,
            ops: bool = True, keep: bool = False) -> PolicyPlan:
    """``plan`` with single ops' outputs kept inside its chosen blocks (``ops``) and, where the
    FSDP2 units are the blocks, some units keeping their parameters (``keep``), each step analysed."""
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


class _Paid:
    """The greedy steps' analyses of ``choice`` with outputs or units kept: each step's own, and
    with cores to spare the one the step after a failure needs, side by side.  A step costs one
    analysis where its choice was not analysed before or only ahead (as one after another would)."""

    def __init__(self, verify: Verifier, choice: tuple[int, ...]) -> None:
        self.verify, self.choice = verify, choice
        self.ahead: set[Any] = set()  # analysed ahead, not yet a step's

    def costs(self, kept: Mapping[int, tuple[str, ...]], units: tuple[int, ...]) -> bool:
        key = (self.choice, kept_key(kept, units))
        new = key not in self.verify.finer or key in self.ahead
        self.ahead.discard(key)
        return new

    def analyse(self, now: tuple[Mapping[int, tuple[str, ...]], tuple[int, ...]],
                ahead: Sequence[tuple[Mapping[int, tuple[str, ...]], tuple[int, ...]]]) -> None:
        ahead = list(ahead) if processes() > 1 else []
        self.ahead.update((self.choice, kept_key(kept, units)) for kept, units in ahead
                          if (self.choice, kept_key(kept, units)) not in self.verify.finer)
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


@dataclass(frozen=True, slots=True)
class _Items:
    """The items a choice's checkpointed blocks could keep, by name (``names``: in finer.py's
    order), and how _finer's greedy steps through them."""

    verify: Verifier
    choice: tuple[int, ...]
    groups: Mapping[str, Sequence[Keepable]]
    names: tuple[str, ...]

    def room(self, made: CheckpointChoice, group: int, members: Sequence[Keepable]) -> int:
        size = max(max(m.nbytes for m in self.groups[self.names[group]]), 1)
        return min(len(members), (self.verify.budget.cap_bytes - made.peak_bytes) // size)

    def settled(self, step: _Step) -> _Step | None:
        """``step``, or the first name after it with blocks to try; None when none is left."""
        while step.count < 1:
            if step.group + 1 >= len(self.names):
                return None
            members = tuple(sorted(self.groups[self.names[step.group + 1]], key=lambda m: m.block))
            step = replace(step, group=step.group + 1, members=members,
                           count=self.room(step.chosen, step.group + 1, members))
        return step

    def trial(self, step: _Step) -> dict[int, tuple[str, ...]]:
        own = dict(step.own)
        for member in step.members[:step.count]:
            own[member.block] = (*own.get(member.block, self.verify.choices.names_of(self.choice, member.block)),
                                 self.names[step.group])
        return own


def _items(verify: Verifier, paths: Sequence[str], choice: tuple[int, ...]) -> _Items:
    groups: dict[str, list[Keepable]] = {}
    mode = train_of(verify.done[choice])
    for item in keepable(mode, paths, choice, verify.costs.op_costs(mode)):
        groups.setdefault(item.name, []).append(item)
    return _Items(verify, choice, groups, tuple(groups))


def _finer(verify: Verifier, paths: Sequence[str], chosen: CheckpointChoice) -> CheckpointChoice:
    """``chosen`` with single ops' outputs kept in its checkpointed blocks (finer.py): items of
    the same name (``attn.proj:matmuls``), the most FLOPs per byte first, in as many blocks as
    the room left holds (the earliest first), then in half as many while an analysis says the
    step no longer fits or recomputes no less; at most FINER_ANALYSES steps that analyse.  With
    cores to spare, the step after a failure is analysed beside each step (the same answer)."""
    choice = choice_of(chosen, len(paths))
    items = _items(verify, paths, choice)
    step = items.settled(_Step(-1, (), 0, {}, chosen))
    paid = _Paid(verify, choice)
    tried = 0
    while step is not None and tried < FINER_ANALYSES:
        now, otherwise = items.trial(step), items.settled(replace(step, count=step.count // 2))
        tried += paid.costs(now, ())
        paid.analyse((now, ()), [(items.trial(otherwise), ())] if otherwise is not None else [])
        made = verify.kept_choice(choice, now)
        if made.fits and made.recompute_cost < step.chosen.recompute_cost:
            rest = step.members[step.count:]
            step = items.settled(replace(step, own=now, chosen=made, members=rest,
                                         count=items.room(made, step.group, rest)))
            chosen = made
        else:
            step = otherwise
    return chosen


def _keep_units(verify: Verifier, n: int, chosen: CheckpointChoice) -> CheckpointChoice:
    """``chosen`` (its FSDP2 units resharding after forward) with the last units keeping their
    parameters instead, as many as the room left holds by the bytes each all-gathers again in
    backward, fewer (halved) while an analysis says the step no longer fits; then more while it
    fits; each kept unit all-gathers its parameters once per step instead of twice.  At most
    FINER_ANALYSES steps that analyse; with cores to spare, the step after a failure is analysed
    beside each step (the same answer)."""
    size = chosen.gathered_bytes // n if n else 0
    if size <= 0:
        return chosen
    choice = choice_of(chosen, n)
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
