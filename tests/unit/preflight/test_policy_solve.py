"""The checkpointing policy's integer program (graphmem.preflight.policy.solve) against exhaustive
search over every per-block choice, on composites built by hand: random tables per run, far
terms, and tensors held while any of some blocks is checkpointed."""

from __future__ import annotations

import itertools
import random

import pytest

from graphmem.errors import UserInputError
from graphmem.job.grammar import format_blocks, format_save_in, parse_blocks, parse_save_in
from graphmem.job.job import make_job
from graphmem.preflight.policy.composite import Composite, RunBound
from graphmem.preflight.policy.solve import least_peak, least_recompute, pareto_front
from graphmem.report.policy_file import torchtitan_settings
from tests.optional import needs


def _random_composite(seed: int, blocks: int) -> Composite:
    rng = random.Random(seed)
    bounds = []
    for run in range(3 * blocks):
        near = tuple(sorted(rng.sample(range(blocks), rng.randint(1, min(3, blocks)))))
        local = {combo: rng.randrange(10**8, 2 * 10**8) for combo in itertools.product(range(2), repeat=len(near))}
        far = {(j, v): rng.randrange(0, 10**7) for j in range(blocks) if j not in near for v in range(2)
               if rng.random() < 0.7}
        held = ((rng.randrange(10**5, 10**6), tuple(rng.sample(range(blocks), 2))),) if rng.random() < 0.3 \
            else ()
        bounds.append(RunBound(run, near, local, far, held))
    cost = tuple((0, rng.randrange(1, 50) * 2**20) for _ in range(blocks))
    return Composite(blocks, 2, tuple(bounds), cost, exact=True, notes=())


def _brute(composite: Composite, cap: int) -> tuple[int, int] | None:
    """(least recompute, lowest peak among those) over every choice under ``cap``, or None."""
    fits = [(composite.recompute(c), composite.peak(c)) for c in itertools.product(range(2), repeat=composite.blocks)
            if composite.peak(c) <= cap]
    return min(fits) if fits else None


@needs("pulp")
@pytest.mark.parametrize("seed", range(6))
def test_least_recompute_is_the_exhaustive_optimum(seed: int) -> None:
    composite = _random_composite(seed, blocks=6)
    peaks = sorted({composite.peak(c) for c in itertools.product(range(2), repeat=6)})
    for cap in [peaks[0] - 1, peaks[0], peaks[len(peaks) // 3], peaks[len(peaks) // 2], peaks[-1]]:
        found = least_recompute(composite, cap)
        expected = _brute(composite, cap)
        if expected is None:
            assert found is None
        else:
            assert found is not None and (composite.recompute(found), composite.peak(found)) == expected


@needs("pulp")
def test_front_and_lowest_peak() -> None:
    composite = _random_composite(11, blocks=5)
    choices = list(itertools.product(range(2), repeat=5))
    front = pareto_front(composite)
    points = [(composite.recompute(c), composite.peak(c)) for c in front]
    # every choice is dominated by (or equal to) a point of the front; the points strictly improve
    for c in choices:
        assert any(r <= composite.recompute(c) and p <= composite.peak(c) for r, p in points)
    assert all(a[0] < b[0] and a[1] > b[1] for a, b in itertools.pairwise(points))
    lowest = least_peak(composite)
    assert composite.peak(lowest) == min(composite.peak(c) for c in choices) == points[-1][1]


def _alike_blocks(blocks: int, variants: int) -> Composite:
    """Blocks alike as a large model's (tens of GiB, GiB per block), each run's bytes a few hundred
    bytes apart from block to block: choices differ by far less than CBC's tolerances on raw bytes
    (the solver once called every cap below two blocks' "nothing fits")."""
    gib = 2**30
    saved = (3 * gib // 2, gib // 8, gib // 2)[:variants]  # kept, checkpointed whole, selective
    bounds = []
    for i in range(blocks):  # forward of block i, then (below) its backward, with recompute
        far = {(j, k): saved[k] for j in range(i) for k in range(variants)}
        bounds.append(RunBound(i, (i,), {(k,): 30 * gib + saved[k] + 12345 * i for k in range(variants)}, far, ()))
        bounds.append(RunBound(blocks + i, (i,), {(k,): 30 * gib + 3 * gib // 2 + (gib // 4 if k else 0) + 777 * i
                                                   for k in range(variants)}, far, ()))
    cost = tuple((0, 10**12, 4 * 10**11)[:variants] for _ in range(blocks))
    return Composite(blocks, variants, tuple(bounds), cost, exact=True, notes=())


@needs("pulp")
@pytest.mark.parametrize(("blocks", "variants"), [(8, 2), (5, 3)])
def test_bytes_of_a_large_model_are_solved_exactly(blocks: int, variants: int) -> None:
    composite = _alike_blocks(blocks, variants)
    choices = list(itertools.product(range(variants), repeat=blocks))
    every = sorted((composite.recompute(c), composite.peak(c)) for c in choices)
    peaks = sorted({p for _, p in every})
    for cap in [peaks[0], peaks[1] - 1, peaks[len(peaks) // 3], peaks[-2]]:
        found = least_recompute(composite, cap)
        assert found is not None and (composite.recompute(found), composite.peak(found)) == min(
            (r, p) for r, p in every if p <= cap), cap
    front = [(composite.recompute(c), composite.peak(c)) for c in pareto_front(composite)]
    best: list[tuple[int, int]] = []
    for r, p in every:  # the exhaustive front: each next point strictly lower
        if not best or p < best[-1][1]:
            best.append((r, p))
    assert front == best


def test_block_lists() -> None:
    assert parse_blocks("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_blocks("") == ()
    assert format_blocks((6, 0, 1, 2, 3)) == "0-3,6"
    assert format_blocks(()) == ""
    for bad in ("3-1", "1,1", "a", "-2"):
        with pytest.raises(UserInputError, match="--checkpoint-blocks"):
            parse_blocks(bad)


def test_per_block_save_lists() -> None:
    text = "0=attn.proj:matmuls;2-3=matmuls,attention"
    parsed = parse_save_in(text)
    assert parsed == ((0, ("attn.proj:matmuls",)), (2, ("matmuls", "attention")), (3, ("matmuls", "attention")))
    assert format_save_in(parsed) == "0=attn.proj:matmuls;2-3=matmuls,attention"
    assert parse_save_in("") == ()
    for bad in ("0", "0=", "1=matmuls;1=attention", "x=matmuls"):
        with pytest.raises(UserInputError):
            parse_save_in(bad)


@pytest.mark.parametrize("options, problem", [
    ({"checkpoint_blocks": "0", "checkpoint_save_in": "1=matmuls"}, "among --checkpoint-blocks"),
    ({"checkpoint_blocks": "0", "checkpoint_save_in": "0=proj:sofmax"}, "unknown proj:sofmax"),
    ({"checkpoint_save": "proj:matmul"}, "unknown proj:matmul"),
])
def test_per_block_save_lists_are_checked(options: dict[str, str], problem: str) -> None:
    with pytest.raises(UserInputError, match=problem):
        make_job("x:Y", ["2x4"], checkpoint="Block", **options).step.validate()


def test_torchtitan_settings() -> None:
    # torchtitan's apply_ac wraps the layers whose count from 1 is a multiple of k
    assert torchtitan_settings((1, 3, 5, 7), 8) == {"mode": "selective", "selective_ac_option": "2"}
    assert torchtitan_settings((2, 5), 6) == {"mode": "selective", "selective_ac_option": "3"}
    assert torchtitan_settings(tuple(range(4)), 4) == {"mode": "full"}
    assert torchtitan_settings((), 4) == {"mode": "none"}
    assert torchtitan_settings((0, 1), 4) is None
