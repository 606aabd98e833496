"""--parallel against real multi-process runs: every rank's peak and per-phase peaks, to the byte.

Each case runs the step for real in separate gloo processes on CPU (tests/dist_oracles.py) and
compares every rank with graphmem's prediction for that rank (the rank it stands with).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import graphmem
from tests.dist_oracles import measure_distributed
from tests.optional import extended
from tests.parallel_cases import CASES, ParallelCase

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


# the MLP's variants whose same setting runs by default on the small GPT (or, for tp's SGD,
# with Adam; for ZeRO-1, on 4 ranks): with GRAPHMEM_EXTENDED=1
_MORE = {"MLP-ddp2-sgd", "MLP-fsdp2-sgd", "MLP-ddp2-adam-gradient_as_bucket_view=True",
         "MLP-fsdp2-adam-param_dtype=bfloat16,reduce_dtype=float32", "MLP-hsdp4-adam", "MLP-zero12-adam",
         "MLP-tp2-sgd", "MLP-fsdp2-adam-reshard_after_forward=True", "MLP-fsdp2-adam-reshard_after_forward=False"}
_GATED = extended("the same setting runs by default on the small GPT (tp: with Adam; ZeRO-1: on 4 ranks)")


@pytest.mark.parametrize("case", [pytest.param(c, marks=_GATED) if c.name in _MORE else c for c in CASES],
                         ids=lambda c: c.name)
@pytest.mark.slow  # a real run per rank, in processes: 6 to 33 s
def test_every_rank_matches_real_execution(case: ParallelCase) -> None:
    measured = measure_distributed(**case.oracle_keywords())
    report = graphmem.analyze(**case.graphmem_keywords())
    assert report.train is not None
    predicted = {rank: group.report for group in report.train.ranks for rank in group.ranks}
    assert sorted(predicted) == list(range(case.world_size))
    for m in measured:
        mine = predicted[m.rank]
        assert mine.peak_bytes == m.peak_bytes, f"rank {m.rank}"
        assert {p.phase: p.peak_bytes for p in mine.phases} == m.phase_peaks, f"rank {m.rank}"
    assert report.train.peak_bytes == max(m.peak_bytes for m in measured)
