"""The peak of any per-block checkpointing choice, from a few recordings of the step.

Input: recordings of one training step (``Recorded``: each block's variant, 0 kept or 1
checkpointed, and the analysed ``ModeReport``), with every block kept, every block checkpointed,
and the two alternations (every even block, every odd one), and the blocks' module paths.
Output: a ``Composite``: per run of ops, a ``RunBound`` whose value for a choice is the live bytes
at the run's highest op, and per block and variant the FLOPs recomputed.  Pure.

Why a few recordings are enough.  Cut every recording into the same runs (runs.py): the runs of
block i's forward and backward hold the same ops in every recording where block i has the same
variant, and the runs outside the blocks the same ops in all.  Give every storage an owner: the
block whose run created it (outside: none).  At an op of run X the live bytes are the sum, over
owners, of the owner's storages live there.  An owner's storages that span X (made before it,
freed after it) add a constant that depends on the owner's variant; those that begin or end in X
(a block's output saved by the next block, the gradient one block hands the one before) add bytes
that depend on where in X they begin or end: on the variants of the owner and of X's block.
So, for a choice, run X's bytes are the sum of per-owner parts, each read from a recording where
the owner and X's block have the variants of the choice: the alternations hold every pair of
neighbours in both orders, and the uniform recordings every pair alike.  Tensors that every
checkpointed block holds until its own backward (a position-id or mask tensor passed to each block,
kept by checkpoint for the recompute) are freed by the earliest checkpointed block, a choice that
no pair decides: they are counted as ``Shared``, live until the last run of a block that holds
them, to the end of that run (an upper bound by their bytes in that one run).

What would break it is checked, not assumed: two recordings that agree on the variants an owner's
part depends on must give that part equal bytes, op for op.  Where they differ (a third block's
variant mattered), or a pair is missing, the part is bounded by the largest recorded value, and
``exact`` is False.  The analysis of the chosen policy decides in any case (search.py).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from graphmem.errors import UnsupportedError
from graphmem.job.option import spelling
from graphmem.memory.results import ModeReport
from graphmem.preflight.policy.costs import FLOPS, CostModel
from graphmem.preflight.policy.runs import Runs, cut_runs
from graphmem.records import Phase

__all__ = ["OUT", "Composite", "Recorded", "RunBound", "Shared", "build_composite", "merge_composites"]

OUT = -1  # the owner of storages made outside every block (parameters, inputs, the loss, ...)
_MOST_NEAR = 8  # blocks whose variants one run's bytes may depend on, op by op (2^8 sums)


@dataclass(frozen=True, slots=True)
class Recorded:
    """One recording: each block's variant (0 kept, 1 checkpointed) and the analysed train step."""

    choice: tuple[int, ...]
    mode: ModeReport


@dataclass(frozen=True, slots=True)
class RunBound:
    """The live bytes at the highest op of one run, as a function of the choice.

    ``near``: blocks whose variants decide the bytes op by op; ``local``: for each of their
    variants (in ``near``'s order), the highest op's bytes from them and every owner whose part
    is the same whatever the choice.  ``far``: (block, variant) -> bytes that block's storages
    add through the whole run.  ``held``: (bytes, blocks): bytes live through the run when any
    of the blocks is checkpointed (Shared)."""

    run: int
    near: tuple[int, ...]
    local: Mapping[tuple[int, ...], int]
    far: Mapping[tuple[int, int], int]
    held: tuple[tuple[int, tuple[int, ...]], ...]

    def value(self, choice: Sequence[int]) -> int:
        """The run's highest live bytes for ``choice`` (each block's variant)."""
        total = self.local[tuple(choice[i] for i in self.near)]
        total += sum(self.far.get((block, variant), 0) for block, variant in enumerate(choice))
        return total + sum(nbytes for nbytes, blocks in self.held if any(choice[b] for b in blocks))


@dataclass(frozen=True, slots=True)
class Shared:
    """A storage made outside the blocks that each checkpointed block holds until its backward.

    Live from ``created`` (its run; ``head``: its bytes by op there) through ``released`` (its
    last run with no block checkpointed) and, with blocks checkpointed, through ``held[i]``, the
    last run of block i's backward in its iteration, for the earliest such block."""

    nbytes: int
    created: int
    head: tuple[int, ...]
    released: int
    held: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Composite:
    """Every run's bound; ``cost[block][variant]``: what that variant recomputes (both recorded
    iterations), by the CostModel the composite was built with (FLOPs, or a roofline time)."""

    blocks: int
    variants: int
    bounds: tuple[RunBound, ...]
    cost: tuple[tuple[int, ...], ...]
    exact: bool
    notes: tuple[str, ...]

    def peak(self, choice: Sequence[int]) -> int:
        """The step's peak bytes with ``choice`` (each block's variant)."""
        return max(bound.value(choice) for bound in self.bounds)

    def recompute(self, choice: Sequence[int]) -> int:
        return sum(self.cost[block][variant] for block, variant in enumerate(choice))


@dataclass(frozen=True, slots=True)
class _Tables:
    """One recording's bytes by (owner, run): ``span``, live through the run; ``touch``, per op
    of the run, of the storages that begin or end in it."""

    choice: tuple[int, ...]
    runs: Runs
    span: Mapping[tuple[int, int], int]
    touch: Mapping[tuple[int, int], tuple[int, ...]]
    scratch: tuple[tuple[int, ...], ...]
    owners: Mapping[int, frozenset[int]]  # run -> the owners with bytes there (an index of the two above)


def _owner(runs: Runs, start: int) -> int:
    if start < 0:
        return OUT
    block = runs.runs[runs.run_of[start]].block
    return OUT if block is None else block


def _tables(recorded: Recorded, runs: Runs, skip: frozenset[int]) -> _Tables:
    """``recorded``'s bytes by owner and run, the storages ``skip`` names left out."""
    span_delta: dict[int, list[int]] = defaultdict(lambda: [0] * (len(runs.runs) + 1))
    touch_delta: dict[tuple[int, int], list[int]] = {}
    for life in recorded.mode.lifetimes:
        if life.sid in skip:
            continue
        owner = _owner(runs, life.start)
        first = runs.run_of[life.start] if life.start >= 0 else -1
        last = runs.run_of[life.end]
        # spans: every run strictly between the first and the last
        span_delta[owner][first + 1] += life.nbytes
        span_delta[owner][max(last, first + 1)] -= life.nbytes
        # touches: the first and the last run, from where it begins to where it ends
        for run in {first, last} - {-1}:
            start, stop = runs.runs[run].start, runs.runs[run].stop
            delta = touch_delta.setdefault((owner, run), [0] * (stop - start + 1))
            delta[max(life.start, start) - start] += life.nbytes
            delta[min(life.end, stop - 1) - start + 1] -= life.nbytes
    span = {(owner, run): value for owner, delta in span_delta.items()
            for run, value in enumerate(itertools.accumulate(delta[:-1])) if value}
    touch = {key: tuple(itertools.accumulate(delta[:-1])) for key, delta in touch_delta.items()}
    ops = recorded.mode.trace.ops
    scratch = tuple(tuple(op.scratch_bytes for op in ops[run.start:run.stop]) for run in runs.runs)
    owners: dict[int, set[int]] = defaultdict(set)
    for owner, run in (*span, *touch):
        owners[run].add(owner)
    return _Tables(recorded.choice, runs, span, touch, scratch, {r: frozenset(o) for r, o in owners.items()})


def _line_up(all_runs: Sequence[Runs], choices: Sequence[tuple[int, ...]]) -> None:
    """Check that the recordings cut into the same runs, each as long as in every recording
    with the same variant of its block.

    Raises:
        UnsupportedError: they do not line up (the blocks run differently with the choice).
    """
    first = all_runs[0].blocks
    lengths: dict[tuple[int, Hashable], set[int]] = defaultdict(set)
    for runs, choice in zip(all_runs, choices, strict=True):
        if runs.blocks != first:
            raise UnsupportedError("--policy: the step runs its blocks in another order with some blocks "
                                   f"checkpointed; choose with {spelling('checkpoint_blocks')} and graphmem analyze "
                                   "instead")
        for index, run in enumerate(runs.runs):
            lengths[index, None if run.block is None else choice[run.block]].add(run.length)
    uneven = [index for (index, _), seen in lengths.items() if len(seen) > 1]
    if uneven:
        raise UnsupportedError(f"--policy: run {uneven[0]} of the step holds other ops with other blocks "
                               f"checkpointed; choose with {spelling('checkpoint_blocks')} and graphmem analyze "
                               "instead")


def _iteration_ends(runs: Runs, recorded: Recorded, blocks: int) -> dict[int, tuple[int, ...]]:
    """Per iteration, each block's last run of its backward in it (the optimizer's ops on a
    block's parameters are that block's too: they come later and hold nothing of it)."""
    ops = recorded.mode.trace.ops
    ends: dict[int, list[int]] = defaultdict(lambda: [-1] * blocks)
    for index, run in enumerate(runs.runs):
        if run.block is not None and ops[run.start].phase == Phase.BACKWARD:
            ends[ops[run.start].iteration][run.block] = index
    return {it: tuple(last) for it, last in ends.items()}


def _made_outside(recorded: Recorded, runs: Runs) -> dict[tuple[int, int, int], tuple[int, int, int, int]]:
    """Storages made in a run outside the blocks, keyed alike in every recording (run, op offset,
    order among the op's storages) -> (sid, bytes, first op, last op)."""
    by_op: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    for life in recorded.mode.lifetimes:
        if life.start >= 0 and runs.runs[runs.run_of[life.start]].block is None:
            by_op[life.start].append((life.sid, life.nbytes, life.start, life.end))
    out = {}
    for start, made in by_op.items():
        run = runs.run_of[start]
        for order, item in enumerate(sorted(made)):
            out[run, start - runs.runs[run].start, order] = item
    return out


def _shared(recordings: Sequence[Recorded], all_runs: Sequence[Runs], blocks: int
            ) -> tuple[list[Shared], list[frozenset[int]], list[str]]:
    """The storages made outside the blocks whose release moves with the choice (Shared), the
    sids to leave out of each recording's tables, and notes where the rule did not hold."""
    base = next(i for i, r in enumerate(recordings) if not any(r.choice))
    ends = _iteration_ends(all_runs[base], recordings[base], blocks)
    made = [_made_outside(r, runs) for r, runs in zip(recordings, all_runs, strict=True)]
    shared: list[Shared] = []
    skip: list[set[int]] = [set() for _ in recordings]
    notes: list[str] = []
    for key in made[base]:
        if any(key not in m for m in made):
            continue
        released = [all_runs[k].run_of[m[key][3]] for k, m in enumerate(made)]
        if len(set(released)) == 1:
            continue
        created = key[0]
        ops = recordings[base].mode.trace.ops
        held = ends[ops[made[base][key][2]].iteration]  # the making op's: a run outside may span two
        expected = [max([released[base], *(held[b] for b, v in enumerate(r.choice) if v)]) for r in recordings]
        nbytes = made[base][key][1]
        if expected != released:
            notes.append(f"a {nbytes:,}-byte tensor made outside the blocks is freed where no rule says")
            held = tuple([max(released)] * blocks)
        run = all_runs[base].runs[created]
        head = tuple(nbytes if i >= made[base][key][2] else 0 for i in range(run.start, run.stop))
        shared.append(Shared(nbytes, created, head, released[base], held))
        for k, m in enumerate(made):
            skip[k].add(m[key][0])
    return shared, [frozenset(s) for s in skip], notes


def build_composite(recordings: Sequence[Recorded], blocks: Sequence[str], variants: int = 2,
                    costs: CostModel = FLOPS) -> Composite:
    """The Composite of ``recordings`` (one with every block kept among them) of a model whose
    blocks are the modules at ``blocks`` (paths, in the model's order).

    Raises:
        UnsupportedError: the recordings do not line up run for run (_line_up).
    """
    all_runs = [cut_runs(r.mode.trace, blocks) for r in recordings]
    _line_up(all_runs, [r.choice for r in recordings])
    shared, skip, notes = _shared(recordings, all_runs, len(blocks))
    tables = [_tables(r, runs, s) for r, runs, s in zip(recordings, all_runs, skip, strict=True)]
    bounds = tuple(_bound(run, tables, shared, variants, notes) for run in range(len(all_runs[0].runs)))
    return Composite(len(blocks), variants, bounds, _costs(recordings, all_runs, len(blocks), variants, costs),
                     exact=not notes, notes=tuple(dict.fromkeys(notes)))


def merge_composites(composites: Sequence[Composite]) -> Composite:
    """One Composite whose peak is the highest of ``composites``' (one per distinct rank of a
    ``--parallel`` step, each from that rank's recordings): every run of every rank bounds the
    peak, and a block's recompute is the most any rank makes."""
    first = composites[0]
    if any((c.blocks, c.variants) != (first.blocks, first.variants) for c in composites):
        raise AssertionError("merge_composites: the ranks' composites choose over different blocks")
    cost = tuple(tuple(max(c.cost[b][v] for c in composites) for v in range(first.variants))
                 for b in range(first.blocks))
    notes = tuple(dict.fromkeys(note for c in composites for note in c.notes))
    return Composite(first.blocks, first.variants, tuple(b for c in composites for b in c.bounds), cost,
                     exact=all(c.exact for c in composites), notes=notes)


def _costs(recordings: Sequence[Recorded], all_runs: Sequence[Runs], blocks: int, variants: int,
           model: CostModel) -> tuple[tuple[int, ...], ...]:
    """What each block recomputes in each variant (0 where kept), by ``model`` (costs.py)."""
    cost = [[0] * variants for _ in range(blocks)]
    for recorded, runs in zip(recordings, all_runs, strict=True):
        ops = recorded.mode.trace.ops
        per_op = model.op_costs(recorded.mode)
        done: dict[int, int] = defaultdict(int)
        for run in runs.runs:
            if run.block is not None:
                done[run.block] += sum(c for op, c in zip(ops[run.start:run.stop], per_op[run.start:run.stop],
                                                          strict=True) if op.recompute)
        for block in range(blocks):
            cost[block][recorded.choice[block]] = max(cost[block][recorded.choice[block]], done[block])
    return tuple(tuple(c) for c in cost)


def _part(table: _Tables, owner: int, run: int, length: int) -> tuple[tuple[int, ...], int]:
    """One owner's bytes in one run of one recording: per op, and through the whole run."""
    return table.touch.get((owner, run), (0,) * length), table.span.get((owner, run), 0)


def _bound(run: int, tables: Sequence[_Tables], shared: Sequence[Shared], variants: int, notes: list[str]
           ) -> RunBound:
    """Run ``run``'s RunBound (see the module docstring)."""
    block = tables[0].runs.runs[run].block
    owners = sorted({o for t in tables for o in t.owners.get(run, ())})
    # each owner's part, keyed by (X's block variant, the owner's variant)
    parts: dict[int, dict[tuple[int, int], tuple[tuple[int, ...], int]]] = {}
    for owner in owners:
        seen: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}
        for table in tables:
            mine = -1 if block is None else table.choice[block]
            theirs = -1 if owner == OUT else table.choice[owner]
            length = table.runs.runs[run].length
            part = _part(table, owner, run, length)
            old = seen.get((mine, theirs))
            if old is not None and old != part:
                notes.append("an owner's bytes in a run depend on a third block's variant: bounded by the largest")
                part = (tuple(map(max, old[0], part[0])), max(old[1], part[1]))
            seen[mine, theirs] = part
        parts[owner] = seen
    touching = {o for o in owners if any(any(array) for array, _ in parts[o].values())}
    near = sorted({*(o for o in touching if o not in (OUT, block) and _varies(parts[o], variants)),
                   *([block] if block is not None else [])})
    far_owners = [o for o in owners if o not in touching and o != OUT and _varies(parts[o], variants)]
    if len(near) > _MOST_NEAR:
        raise UnsupportedError(f"--policy: one run's bytes depend on {len(near)} blocks' choices; "
                               f"choose with {spelling('checkpoint_blocks')} and graphmem analyze instead")
    local = {}
    for combo in itertools.product(range(variants), repeat=len(near)):
        local[combo] = _local(run, block, dict(zip(near, combo, strict=True)), tables, parts, far_owners,
                              shared, notes)
    far = {(o, v): _span_of(parts[o], v, notes) for o in far_owners for v in range(variants)}
    return RunBound(run, tuple(near), local, far, _held(run, shared))


def _varies(part: Mapping[tuple[int, int], tuple[tuple[int, ...], int]], variants: int) -> bool:
    """Whether an owner's part may change with its own variant: it does for some variant of the
    run's block, or some of its variants were never recorded beside that one (no recording
    tells: taken as varying)."""
    by_mine: dict[int, dict[int, tuple[tuple[int, ...], int]]] = defaultdict(dict)
    for (mine, theirs), value in part.items():
        by_mine[mine][theirs] = value
    return any(len(seen) < variants or len(set(seen.values())) > 1 for seen in by_mine.values())


def _span_of(part: Mapping[tuple[int, int], tuple[tuple[int, ...], int]], variant: int, notes: list[str]) -> int:
    """The bytes an owner (its variant ``variant``) keeps through a run it does not touch: the
    same in every recording where it has that variant, else bounded by the largest."""
    spans = {span for (_, theirs), (_, span) in part.items() if theirs == variant}
    if len(spans) > 1:
        notes.append("a block's bytes through a run depend on another block's variant: bounded by the largest")
    return max(spans, default=0)


def _local(run: int, block: int | None, fixed: Mapping[int, int], tables: Sequence[_Tables],
           parts: Mapping[int, Mapping[tuple[int, int], tuple[tuple[int, ...], int]]], far_owners: Sequence[int],
           shared: Sequence[Shared], notes: list[str]) -> int:
    """The highest op's bytes of ``run`` with the blocks of ``fixed`` at those variants, from
    every owner that is not far (those add per variant, RunBound.far)."""
    mine = -1 if block is None else fixed[block]
    table = next(t for t in tables if block is None or t.choice[block] == mine)
    per_op = list(table.scratch[run])
    constant = 0
    for owner, part in parts.items():
        if owner in far_owners:
            continue
        theirs = fixed.get(owner)
        found = [p for (m, t), p in part.items() if m == mine and (theirs is None or t == theirs)]
        if not found:  # no recording has this pair: the owner's most, as a constant
            notes.append("a pair of block variants no recording holds: bounded by the largest")
            constant += max(max(p[0], default=0) + p[1] for (_, t), p in part.items() if t == theirs)
            continue
        array, span = found[0]
        per_op = [a + b for a, b in zip(per_op, array, strict=True)]
        constant += span
    for item in shared:
        if item.created == run:
            per_op = [a + b for a, b in zip(per_op, item.head, strict=True)]
        elif item.created < run <= item.released:
            constant += item.nbytes
    return max(per_op) + constant


def _held(run: int, shared: Sequence[Shared]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """Shared storages live through ``run`` only while blocks that hold them are checkpointed."""
    out = []
    for item in shared:
        if item.created < run and run > item.released:
            holders = tuple(b for b, last in enumerate(item.held) if last >= run)
            if holders:
                out.append((item.nbytes, holders))
    return tuple(out)
