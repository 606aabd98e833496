"""Sanity of the per-rank distributed oracle itself (tests/dist_oracles.py); no graphmem involved.

Each run spawns two gloo ranks on this machine (about 3 s each on 2 cores).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests import dist_oracles
from tests.dist_oracles import PHASES, measure_distributed
from tests.models import MLP

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

INPUT_BYTES = 8 * 1000 * 4  # "8x1000" float32


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _fsdp_shard_bytes(model: torch.nn.Module, world_size: int) -> int:
    """Padded dim-0 shards: ceil(dim0 / N) rows of (numel / dim0) elements per parameter."""
    return sum(math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0]) * p.element_size()
               for p in model.parameters())


@pytest.mark.slow
def test_same_configuration_twice_gives_identical_per_rank_peaks() -> None:
    # FSDP2 on the small GPT: all-gathers, reduce-scatters and resized storages in every iteration
    config = dict(strategy="fsdp", units=("Block",), optimizer="adam", loss="cross_entropy")
    first = measure_distributed("tests.dist_oracles:small_gpt", ["2x16:int64"], **config)
    second = measure_distributed("tests.dist_oracles:small_gpt", ["2x16:int64"], **config)
    assert first == second
    assert [r.rank for r in first] == [0, 1]
    for measured in first:
        assert set(measured.phase_peaks) == set(PHASES)
        assert measured.peak_bytes == max(measured.phase_peaks.values())
        assert measured.peak_bytes > measured.start_bytes


def test_ddp_start_is_parameters_plus_buckets_plus_inputs() -> None:
    params = _param_bytes(MLP())
    measured = measure_distributed("tests.models:MLP", ["8x1000"], strategy="ddp", optimizer="sgd")
    for rank in measured:
        # the Reducer's gradient buckets hold exactly the parameter bytes
        assert rank.start_bytes == params + params + INPUT_BYTES
    assert [d["ddp_bucket_bytes"] for d in dist_oracles.LAST_DETAILS] == [params, params]
    assert measured[0].peak_bytes == measured[1].peak_bytes  # same shapes, replicated state
    assert measured[0].phase_peaks == measured[1].phase_peaks


@pytest.mark.parametrize("build, sizes", [("tests.models:MLP", (1000, 500, 100)),
                                          ("tests.dist_oracles:uneven_mlp", (999, 501, 99))],
                         ids=["even", "padded"])
@pytest.mark.slow
def test_fsdp_start_is_padded_dim0_shards_plus_inputs(build: str, sizes: tuple[int, ...]) -> None:
    shards = _fsdp_shard_bytes(MLP(sizes), 2)
    input_bytes = 8 * sizes[0] * 4
    measured = measure_distributed(build, [f"8x{sizes[0]}"], strategy="fsdp", units=("Linear",), optimizer="sgd")
    assert [r.start_bytes for r in measured] == [shards + input_bytes] * 2


def test_a_failing_rank_raises_instead_of_hanging() -> None:
    with pytest.raises(RuntimeError, match="no_such_model"):
        measure_distributed("tests.models:no_such_model", ["8x1000"], strategy="ddp")
