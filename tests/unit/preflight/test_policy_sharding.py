"""plan --policy under --parallel fsdp=N (graphmem.preflight.policy.sharding): the setting of
reshard_after_forward chosen after each setting's own least recompute is the optimum of exhaustive
search over every (setting, per-block choice) pair; the per-rank composites merged bound the peak
of the rank that needs the most."""

from __future__ import annotations

import itertools
import random

import pytest

from graphmem.preflight.policy.composite import Composite, RunBound, merge_composites
from graphmem.preflight.policy.sharding import choose_setting
from graphmem.preflight.policy.solve import least_recompute
from tests.optional import needs


def _composite(seed: int, blocks: int) -> Composite:
    """Random tables per run (a few blocks decide each op by op), far terms, random recompute."""
    rng = random.Random(seed)
    bounds = []
    for run in range(2 * blocks):
        near = tuple(sorted(rng.sample(range(blocks), rng.randint(1, 2))))
        local = {combo: rng.randrange(10**6, 2 * 10**6) for combo in itertools.product(range(2), repeat=len(near))}
        far = {(j, v): rng.randrange(0, 10**5) for j in range(blocks) if j not in near for v in range(2)}
        bounds.append(RunBound(run, near, local, far, ()))
    cost = tuple((0, rng.randrange(1, 20) * 1000) for _ in range(blocks))
    return Composite(blocks, 2, tuple(bounds), cost, exact=True, notes=())


def _exhaustive(composites: list[Composite], gathered: list[int], cap: int) -> tuple[int, int] | None:
    """(recompute, bytes all-gathered) least over every setting and every choice under ``cap``."""
    found = [(c.recompute(choice), nbytes) for c, nbytes in zip(composites, gathered, strict=True)
             for choice in itertools.product(range(2), repeat=c.blocks) if c.peak(choice) <= cap]
    return min(found) if found else None


@needs("pulp")
@pytest.mark.parametrize("seed", range(4))
def test_each_settings_least_recompute_then_the_setting_is_the_exhaustive_optimum(seed: int) -> None:
    rng = random.Random(seed)
    # setting 0 gathers in backward (FSDP2's default), setting 1 keeps the parameters: fewer bytes
    # gathered, a higher peak everywhere (its tables shifted up by a random amount per run)
    default = _composite(seed, blocks=4)
    kept = Composite(4, 2, tuple(RunBound(b.run, b.near, {k: v + rng.randrange(0, 4 * 10**5) for k, v in
                                                            b.local.items()}, b.far, ()) for b in default.bounds),
                     default.cost, exact=True, notes=())
    composites, gathered = [default, kept], [800_000, 0]
    peaks = sorted({c.peak(choice) for c in composites for choice in itertools.product(range(2), repeat=4)})
    for cap in [peaks[0] - 1, peaks[0], peaks[len(peaks) // 4], peaks[len(peaks) // 2], peaks[-1]]:
        answers = [least_recompute(c, cap) for c in composites]
        costs = [(c.recompute(a), nbytes) if a is not None else None
                 for c, a, nbytes in zip(composites, answers, gathered, strict=True)]
        picked = choose_setting(costs)
        expected = _exhaustive(composites, gathered, cap)
        assert (None if picked is None else costs[picked]) == expected, cap


def test_choose_setting_takes_the_least_recompute_then_the_fewest_bytes() -> None:
    assert choose_setting([(100, 800), (100, 0)]) == 1
    assert choose_setting([(100, 800), (200, 0)]) == 0
    assert choose_setting([None, (200, 0)]) == 1
    assert choose_setting([None, None]) is None


@pytest.mark.parametrize("seed", range(3))
def test_merged_ranks_peak_is_the_highest_ranks(seed: int) -> None:
    ranks = [_composite(seed * 10 + r, blocks=4) for r in range(3)]
    merged = merge_composites(ranks)
    for choice in itertools.product(range(2), repeat=4):
        assert merged.peak(choice) == max(c.peak(choice) for c in ranks)
        assert merged.recompute(choice) == sum(max(c.cost[b][v] for c in ranks) for b, v in enumerate(choice))


@needs("pulp")
def test_the_front_proven_within_a_time_limit_is_the_whole_front() -> None:
    from graphmem.preflight.policy.solve import pareto_front, search_front

    composite = _composite(7, blocks=5)
    found = search_front(composite, seconds=60)
    assert found.complete and list(found.points) == pareto_front(composite)
