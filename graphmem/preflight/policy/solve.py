"""The per-block choice with the least recompute whose peak stays under a cap, as an integer
program solved by CBC (through PuLP, the ``plan`` extra).

Input: a ``Composite`` (composite.py) and a cap in bytes.  Output: each block's variant (0 kept,
1 checkpointed whole, 2 selective), or None when no choice stays under the cap; the choice with the least peak; the
front of choices where none other has both less recompute and a lower peak.

The program.  One binary per block and variant, one of them set per block.  The peak P is at
least every run's bytes; a run's bytes (RunBound) are a table over the variants of the few blocks
that decide them op by op (``near``), plus a term per variant of every other block that keeps
bytes through the run (``far``), plus tensors held while any of some blocks is checkpointed
(``held``: a variable at least each of their binaries).  A table is read through one variable per
combination of its blocks' variants, at most each binary it needs and one in all (set by the
binaries, and the convex hull of the table: no big constant, whose relaxation let CBC branch for
minutes over 32 alike blocks).  Minimise the recompute with P under the cap; the least P among the
choices of that recompute breaks ties, then the earliest blocks.

Bytes.  CBC works in doubles with tolerances relative to its coefficients: with raw bytes of a
model of tens of GiB, choices KiB over the cap passed as under it, alike blocks gave as many such
near-ties as blocks, each was cut off in turn, and the program gave up ("no choice fits" where
most did; tests/unit/preflight/test_policy_solve.py).  So bytes enter in units of a power of two
that keeps every coefficient under 2^24 (1 B while each term is under 16 MiB: small models
exactly), in two programs: bytes rounded up (every answer fits, but one within a few units of the
cap may be passed over) and bytes rounded down (every choice that fits is there, and an answer
over the cap is cut off); the better answer of the two is the answer.  Each answer is evaluated
again with the composite in whole bytes; one that the solver's tolerances let over the cap is cut
off and the program solved again, up to five times: past that, the rounded-down program's answers
are alike blocks' near-ties a few units over the cap, one after another, and the rounded-up
program's answer stands (on Llama-3-8B's 32 layers, 20 cut-offs a point took 34 s of the front's
38 s and found the same front as 5).  The two programs' solves run side by side (CBC is a process
of its own per solve).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from graphmem.errors import UserInputError
from graphmem.preflight.policy.composite import Composite

__all__ = ["SOLVER", "Front", "least_peak", "least_recompute", "pareto_front", "search_front"]

T = TypeVar("T")

SOLVER = "CBC (COIN-OR branch and cut), through PuLP"
_MOST_CUTS = 5  # answers cut off for the solver's tolerance (or rounding down) before giving up
_BYTE_BITS = 24  # bytes enter the program below 2^24 units (the module docstring)
_QUICK_SECONDS = 5  # a tie-break among alike blocks can branch for minutes: the best found by then
_FOUND = (1, 2)  # PuLP's solution statuses with a solution: optimal, or the best a time limit found
_PROVEN = 1  # PuLP's solution status of an optimum proven so


class _Stopped(Exception):
    """A bounded solve ran out of time before it proved an optimum (or that none exists)."""


@dataclass(frozen=True, slots=True)
class Front:
    """The front's points, fewest recompute first; ``complete`` False: the solver stopped on its
    time limit looking for the next lower peak (a lower one may exist)."""

    points: tuple[tuple[int, ...], ...]
    complete: bool


def _pulp() -> Any:
    try:
        import pulp
    except ImportError as exc:
        raise UserInputError("--policy solves an integer program with PuLP (its CBC solver): "
                             "pip install 'graphmem[plan]' (or pip install pulp)") from exc
    return pulp


def _cbc(pulp: Any, time_limit: float | None = None) -> Any:
    """CBC: the one ``pip install 'pulp[cbc]'`` installs (PuLP 3.3 and later), else the one PuLP's
    wheel bundles (deprecated there, still shipped)."""
    # a binary within CBC's default integrality tolerance (1e-7) of 1 lets a byte-sized
    # coefficient slip a few bytes past the cap; CBC then cut off the true optimum as worse
    # than that near-solution and called the program infeasible
    options = ["integerT 1e-12"]
    coin = pulp.COIN_CMD(msg=False, options=options, timeLimit=time_limit)
    if coin.available():
        return coin
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, options=options, timeLimit=time_limit)


class _Program:
    """The integer program of one Composite; ``solve`` answers one question at a time."""

    def __init__(self, composite: Composite, *, up: bool = True, seconds: float | None = None) -> None:
        pulp = _pulp()
        self.pulp = pulp
        self.composite = composite
        n, v = composite.blocks, composite.variants
        self.problem = pulp.LpProblem("checkpointing", pulp.LpMinimize)
        self.x = [[self._variable(f"x_{i}_{k}", cat="Binary") for k in range(v)] for i in range(n)]
        for i in range(n):
            self.problem += pulp.lpSum(self.x[i]) == 1
        self.peak = self._variable("peak", lowBound=0)
        # seconds: each answer proven optimal within them, else _Stopped (the front ends there)
        self.solver, self.quick = _cbc(pulp, time_limit=seconds), _cbc(pulp, time_limit=_QUICK_SECONDS)
        self.bounded = seconds is not None
        # coefficients CBC's tolerances hold exactly: bytes in units of a power of two that keeps
        # every one under 2^24 (module docstring), FLOPs over their common divisor (and below 2^30)
        largest = max((b.local[c] for b in composite.bounds for c in b.local), default=1)
        self.byte_unit = 1 << max(0, (largest >> _BYTE_BITS).bit_length())
        self.up = up
        costs = [c for row in composite.cost for c in row if c]
        self.flop_unit = max(math.gcd(*costs) if costs else 1, -(-max(costs, default=1) // 2**30))
        self.cost = pulp.lpSum(self._flops(composite.cost[i][k]) * self.x[i][k] for i in range(n) for k in range(v))
        self._held: dict[tuple[int, ...], Any] = {}
        self._tables: dict[tuple[int, ...], dict[tuple[int, ...], Any]] = {}
        self._constrain()

    def _bytes(self, nbytes: int) -> int:
        """``nbytes`` in the program's unit, rounded up (``up``: a sum of them under the cap in
        units is a sum of bytes under the cap) or down (every sum of bytes under the cap is under
        it in units)."""
        return -(-nbytes // self.byte_unit) if self.up else nbytes // self.byte_unit

    def _cap(self, cap: int) -> int:
        """``cap`` bytes in the program's unit, rounded down."""
        return cap // self.byte_unit

    def _flops(self, flops: int) -> int:
        return round(flops / self.flop_unit)

    def scaled_cost(self, choice: Sequence[int]) -> int:
        return sum(self._flops(self.composite.cost[i][k]) for i, k in enumerate(choice))

    def _variable(self, name: str, **bounds: Any) -> Any:
        """A variable of the program (PuLP 3.3 attaches it to the program; older PuLP builds it alone)."""
        add = getattr(self.problem, "add_variable", None)
        return add(name, **bounds) if add is not None else self.pulp.LpVariable(name, **bounds)

    def _held_variable(self, blocks: tuple[int, ...]) -> Any:
        """A variable at least every checkpointed variant's binary of ``blocks`` (1 when any is)."""
        if blocks not in self._held:
            y = self._variable(f"held_{len(self._held)}", lowBound=0, upBound=1)
            for b in blocks:
                for k in range(1, self.composite.variants):
                    self.problem += y >= self.x[b][k]
            self._held[blocks] = y
        return self._held[blocks]

    def _combos(self, near: tuple[int, ...]) -> dict[tuple[int, ...], Any]:
        """For the blocks ``near``, one variable per combination of their variants, 1 for the
        combination the binaries set and 0 for the others (each at most every binary it needs,
        and one in all): the tightest linear form of a table over them, with no big constant."""
        if near not in self._tables:
            combos = list(itertools.product(range(self.composite.variants), repeat=len(near)))
            z = {c: self._variable(f"z_{len(self._tables)}_{n}", lowBound=0, upBound=1) for n, c in enumerate(combos)}
            self.problem += self.pulp.lpSum(z.values()) == 1
            for combo, variable in z.items():
                for block, variant in zip(near, combo, strict=True):
                    self.problem += variable <= self.x[block][variant]
            self._tables[near] = z
        return self._tables[near]

    def _constrain(self) -> None:
        """P is at least every run's bytes: its table through the combination variables of its
        near blocks, plus its far and held terms (each run once: the second iteration repeats)."""
        seen: set[Any] = set()
        for bound in self.composite.bounds:
            key = (bound.near, tuple(sorted(bound.local.items())), tuple(sorted(bound.far.items())), bound.held)
            if key in seen:
                continue
            seen.add(key)
            z = self._combos(bound.near)
            self.problem += (self.pulp.lpSum(self._bytes(b) * z[c] for c, b in bound.local.items())
                             + self.pulp.lpSum(self._bytes(b) * self.x[j][k] for (j, k), b in bound.far.items())
                             + self.pulp.lpSum(self._bytes(b) * self._held_variable(blocks) for b, blocks in bound.held)
                             <= self.peak)

    def solve(self, objective: Any, extra: Sequence[Any], cap: int | None, *, cut: bool = True,
              quick: bool = False) -> tuple[int, ...] | None:
        """Minimise ``objective`` with the ``extra`` constraints; the choice, or None if none.
        A choice whose peak (the composite's, in whole bytes) is over ``cap`` is cut off and the
        program solved again (``cut`` False: returned as it is, for the caller to weigh).
        ``quick``: the best found in a few seconds will do (a tie-break among alike blocks can
        branch for minutes)."""
        problem = self.problem.copy()
        problem.setObjective(objective)
        # named: a copy numbers its own constraints from 1 again, over the original's
        for n, constraint in enumerate(extra):
            problem.addConstraint(constraint, name=f"extra_{n}")
        for tried in range(_MOST_CUTS):
            status = problem.solve(self.quick if quick else self.solver)
            name = self.pulp.LpStatus[status]
            if self.bounded and not quick and (name == "Not Solved" or name == "Optimal"
                                               and problem.sol_status != _PROVEN):
                raise _Stopped
            if self.pulp.LpStatus[status] != "Optimal" or problem.sol_status not in _FOUND:
                return None
            choice = tuple(self._variant(i) for i in range(self.composite.blocks))
            if cap is None or not cut or self.composite.peak(choice) <= cap:
                return choice
            # the solver's tolerance let it over: cut this choice off
            problem.addConstraint(self.pulp.lpSum(self.x[i][k] for i, k in enumerate(choice))
                                  <= self.composite.blocks - 1, name=f"cut_{tried}")
        return None

    def _variant(self, block: int) -> int:
        """The variant the last solution set for ``block`` (the binary nearest 1)."""
        values = [float(x.value() or 0) for x in self.x[block]]
        return values.index(max(values))

    def least_recompute(self, cap: int | None) -> tuple[int, ...] | None:
        """See least_recompute."""
        limit = [self.peak <= self._cap(cap)] if cap is not None else []
        first = self.solve(self.cost, limit, cap)
        if first is None:
            return None
        best = self.scaled_cost(first)
        tied = self._better(first, self.solve(self.peak, [*limit, self.cost <= best], cap, cut=False, quick=True))
        # among those, the fewest and earliest blocks (the same answer every time, and the
        # nearest to "the first k blocks")
        lowest = self.composite.peak(tied)
        order = self.pulp.lpSum((i + 1) * self.x[i][k] for i in range(self.composite.blocks)
                                for k in range(1, self.composite.variants))
        fewest = self.solve(order, [self.peak <= self._cap(lowest), self.cost <= best], lowest, cut=False, quick=True)
        return self._earliest(self._better(tied, fewest))

    def _earliest(self, choice: tuple[int, ...]) -> tuple[int, ...]:
        """``choice`` with its checkpointed blocks moved to earlier ones where that costs no more
        recompute and no higher peak (the same answer every time, and the nearest to "the first
        k blocks"): a later block's variant and an earlier kept block's swap while they do."""
        current = list(choice)
        peak, cost = self.composite.peak(current), self.composite.recompute(current)
        for early in range(len(current)):
            for late in range(len(current) - 1, early, -1):
                if current[early] or not current[late]:
                    continue
                trial = list(current)
                trial[early], trial[late] = trial[late], 0
                if self.composite.recompute(trial) <= cost and self.composite.peak(trial) <= peak:
                    current = trial
                    break
        return tuple(current)

    def _better(self, known: tuple[int, ...], other: tuple[int, ...] | None) -> tuple[int, ...]:
        """``other`` unless it is missing or worse than ``known`` in recompute or peak."""
        if other is None or self.composite.recompute(other) > self.composite.recompute(known) \
                or self.composite.peak(other) > self.composite.peak(known):
            return known
        return other


class _Programs:
    """The program with bytes rounded up (every answer fits) and, where bytes are rounded, the one
    with bytes rounded down (it holds every choice that fits; an answer over the cap is cut off,
    up to _MOST_CUTS times): the better answer of the two."""

    def __init__(self, composite: Composite, seconds: float | None = None) -> None:
        self.composite = composite
        up = _Program(composite, up=True, seconds=seconds)
        self.programs = (up,) if up.byte_unit == 1 else (up, _Program(composite, up=False, seconds=seconds))

    def _best(self, answers: Sequence[tuple[int, ...] | None]) -> tuple[int, ...] | None:
        found = [a for a in answers if a is not None]
        return min(found, key=lambda c: (self.composite.recompute(c), self.composite.peak(c)), default=None)

    def least_recompute(self, cap: int | None) -> tuple[int, ...] | None:
        return self._best(self._each(lambda program: program.least_recompute(cap)))

    def _each(self, ask: Callable[[_Program], T]) -> list[T]:
        """``ask`` of each program, side by side: CBC runs as a process of its own per solve, so
        the two programs' solves take two cores where there are (the front is some hundred)."""
        if len(self.programs) == 1:
            return [ask(self.programs[0])]
        with ThreadPoolExecutor(len(self.programs)) as pool:
            return list(pool.map(ask, self.programs))

    def least_peak(self) -> tuple[int, ...]:
        lows = [lowest for lowest in self._each(lambda p: p.solve(p.peak, [], None)) if lowest is not None]
        assert lows, "least_peak: every choice is feasible"
        lowest = min(lows, key=self.composite.peak)
        answer = self.least_recompute(self.composite.peak(lowest))
        return answer if answer is not None else lowest


def least_recompute(composite: Composite, cap: int | None) -> tuple[int, ...] | None:
    """The choice with the least recompute whose peak is at most ``cap`` bytes (None: any), the
    lowest peak among equals; None when no choice stays under the cap."""
    return _Programs(composite).least_recompute(cap)


def least_peak(composite: Composite) -> tuple[int, ...]:
    """The choice with the lowest peak, the least recompute among equals."""
    return _Programs(composite).least_peak()


def pareto_front(composite: Composite, most: int = 64) -> list[tuple[int, ...]]:
    """Choices where no other has both less recompute and a lower peak, from no recompute (every
    block kept) to the lowest peak, at most ``most`` of them."""
    return list(search_front(composite, most).points)


def search_front(composite: Composite, most: int = 64, seconds: float | None = None) -> Front:
    """The front of pareto_front, each point's solve given ``seconds`` (None: no limit) to prove
    its optimum: a solve that runs out ends the front there (``complete`` False).  Many alike
    blocks make proving that no choice reaches a lower peak a search over their symmetric
    choices (CBC ran for over ten minutes on Llama-3-8B's 32 layers under FSDP2)."""
    programs = _Programs(composite, seconds)
    front: list[tuple[int, ...]] = []
    cap: int | None = None
    while len(front) < most:
        try:
            choice = programs.least_recompute(cap)
        except _Stopped:
            return Front(tuple(front), complete=False)
        if choice is None:
            break
        front.append(choice)
        cap = composite.peak(choice) - 1
    return Front(tuple(front), complete=True)
