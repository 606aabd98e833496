"""The per-block choice with the least recompute whose peak stays under a cap, as an integer
program solved by CBC (through PuLP, the ``plan`` extra).

Input: a ``Composite`` (composite.py) and a cap in bytes.  Output: each block's variant (0 kept,
1 checkpointed), or None when no choice stays under the cap; the choice with the least peak; the
front of choices where none other has both less recompute and a lower peak.

The program.  One binary per block and variant, one of them set per block.  The peak P is at
least every run's bytes; a run's bytes (RunBound) are a table over the variants of the few blocks
that decide them op by op (``near``), plus a term per variant of every other block that keeps
bytes through the run (``far``), plus tensors held while any of some blocks is checkpointed
(``held``: a variable at least each of their binaries).  Each row of the table is a constraint
that binds only when its blocks have its variants: relaxed otherwise by the row's excess over the
table's least row, which no other row can need.  Minimise the recompute with P under the cap;
the least P among the choices of that recompute breaks ties, then the earliest blocks.  Each
answer is evaluated again with the composite in whole bytes; one that the solver's tolerances let
over the cap is cut off and the program solved again.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

from graphmem.errors import UserInputError
from graphmem.preflight.policy.composite import Composite

__all__ = ["SOLVER", "least_peak", "least_recompute", "pareto_front"]

SOLVER = "CBC (COIN-OR branch and cut), through PuLP"
_MOST_CUTS = 20  # answers cut off for the solver's tolerance before giving up


def _pulp() -> Any:
    try:
        import pulp
    except ImportError as exc:
        raise UserInputError("--policy solves an integer program with PuLP (its CBC solver): "
                             "pip install 'graphmem[plan]' (or pip install pulp)") from exc
    return pulp


def _cbc(pulp: Any) -> Any:
    """CBC: the one ``pip install 'pulp[cbc]'`` installs (PuLP 3.3 and later), else the one PuLP's
    wheel bundles (deprecated there, still shipped)."""
    # a binary within CBC's default integrality tolerance (1e-7) of 1 lets a byte-sized
    # coefficient slip a few bytes past the cap; CBC then cut off the true optimum as worse
    # than that near-solution and called the program infeasible
    options = ["integerT 1e-12"]
    coin = pulp.COIN_CMD(msg=False, options=options)
    if coin.available():
        return coin
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=False, options=options)


class _Program:
    """The integer program of one Composite; ``solve`` answers one question at a time."""

    def __init__(self, composite: Composite) -> None:
        pulp = _pulp()
        self.pulp = pulp
        self.composite = composite
        n, v = composite.blocks, composite.variants
        self.problem = pulp.LpProblem("checkpointing", pulp.LpMinimize)
        self.x = [[self._variable(f"x_{i}_{k}", cat="Binary") for k in range(v)] for i in range(n)]
        for i in range(n):
            self.problem += pulp.lpSum(self.x[i]) == 1
        self.peak = self._variable("peak", lowBound=0)
        self.solver = _cbc(pulp)
        unit = math.gcd(*(c for row in composite.cost for c in row)) or 1
        self.cost = pulp.lpSum(composite.cost[i][k] // unit * self.x[i][k] for i in range(n) for k in range(v))
        self.unit = unit
        self._held: dict[tuple[int, ...], Any] = {}
        self._constrain()

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

    def _constrain(self) -> None:
        seen: set[Any] = set()
        for bound in self.composite.bounds:
            key = (bound.near, tuple(sorted(bound.local.items())), tuple(sorted(bound.far.items())), bound.held)
            if key in seen:
                continue  # the second iteration repeats most runs
            seen.add(key)
            rest = (self.pulp.lpSum(nbytes * self.x[j][k] for (j, k), nbytes in bound.far.items())
                    + self.pulp.lpSum(nbytes * self._held_variable(blocks) for nbytes, blocks in bound.held))
            least = min(bound.local.values())
            for combo, nbytes in bound.local.items():
                off = self.pulp.lpSum(1 - self.x[i][k] for i, k in zip(bound.near, combo, strict=True))
                self.problem += nbytes + rest - (nbytes - least) * off <= self.peak

    def solve(self, objective: Any, extra: Sequence[Any], cap: int | None) -> tuple[int, ...] | None:
        """Minimise ``objective`` with the ``extra`` constraints; the choice, or None if none.
        A choice whose peak (the composite's, in whole bytes) is over ``cap`` is cut off."""
        problem = self.problem.copy()
        problem.setObjective(objective)
        # named: a copy numbers its own constraints from 1 again, over the original's
        for n, constraint in enumerate(extra):
            problem.addConstraint(constraint, name=f"extra_{n}")
        for cut in range(_MOST_CUTS):
            status = problem.solve(self.solver)
            if self.pulp.LpStatus[status] != "Optimal":
                return None
            choice = tuple(self._variant(i) for i in range(self.composite.blocks))
            if cap is None or self.composite.peak(choice) <= cap:
                return choice
            # the solver's tolerance let it over: cut this choice off
            problem.addConstraint(self.pulp.lpSum(self.x[i][k] for i, k in enumerate(choice))
                                  <= self.composite.blocks - 1, name=f"cut_{cut}")
        return None

    def _variant(self, block: int) -> int:
        """The variant the last solution set for ``block`` (the binary nearest 1)."""
        values = [float(x.value() or 0) for x in self.x[block]]
        return values.index(max(values))

    def least_recompute(self, cap: int | None) -> tuple[int, ...] | None:
        """See least_recompute."""
        limit = [self.peak <= cap] if cap is not None else []
        first = self.solve(self.cost, limit, cap)
        if first is None:
            return None
        best = self.composite.recompute(first) // self.unit
        tied = self._better(first, self.solve(self.peak, [*limit, self.cost <= best], cap))
        # among those, the earliest blocks (the same answer every time, and the nearest to
        # "the first k blocks")
        lowest = self.composite.peak(tied)
        order = self.pulp.lpSum((i + 1) * self.x[i][k] for i in range(self.composite.blocks)
                                for k in range(1, self.composite.variants))
        return self._better(tied, self.solve(order, [self.peak <= lowest, self.cost <= best], lowest))

    def _better(self, known: tuple[int, ...], other: tuple[int, ...] | None) -> tuple[int, ...]:
        """``other`` unless it is missing or worse than ``known`` in recompute or peak."""
        if other is None or self.composite.recompute(other) > self.composite.recompute(known) \
                or self.composite.peak(other) > self.composite.peak(known):
            return known
        return other


def least_recompute(composite: Composite, cap: int | None) -> tuple[int, ...] | None:
    """The choice with the least recompute whose peak is at most ``cap`` bytes (None: any), the
    lowest peak among equals; None when no choice stays under the cap."""
    return _Program(composite).least_recompute(cap)


def least_peak(composite: Composite) -> tuple[int, ...]:
    """The choice with the lowest peak, the least recompute among equals."""
    program = _Program(composite)
    lowest = program.solve(program.peak, [], None)
    assert lowest is not None, "least_peak: every choice is feasible"
    answer = program.least_recompute(composite.peak(lowest))
    return answer if answer is not None else lowest


def pareto_front(composite: Composite, most: int = 64) -> list[tuple[int, ...]]:
    """Choices where no other has both less recompute and a lower peak, from no recompute (every
    block kept) to the lowest peak, at most ``most`` of them."""
    program = _Program(composite)
    front: list[tuple[int, ...]] = []
    cap: int | None = None
    while len(front) < most:
        choice = program.least_recompute(cap)
        if choice is None:
            break
        front.append(choice)
        cap = composite.peak(choice) - 1
    return front
