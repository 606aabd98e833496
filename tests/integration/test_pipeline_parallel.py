"""--parallel pp=N: PipelineStage + ScheduleGPipe / Schedule1F1B recorded per rank under the fake group.

Ground truth (tests/dist_oracles.py, strategy "pp"): each stage runs for real, on real CPU tensors,
in its own process, with its sends and receives on PyTorch's fake process group (they move no
data; the receive buffers are real).  Gloo is not used for this strategy: in this torch (2.13) the
schedules' point-to-point messages over gloo hang on CPU.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import graphmem
from graphmem.errors import UserInputError
from graphmem.job.parallel import ParallelSpec, parse_parallel
from graphmem.trace.distributed import pipeline_split

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

GPT = dict(model="tests.dist_oracles:small_gpt", inputs=["4x16:int64"], mode="train", loss="cross_entropy")


def test_split_is_contiguous_and_even_first_stages_larger() -> None:
    assert pipeline_split(5, 2) == [range(0, 3), range(3, 5)]
    assert pipeline_split(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(UserInputError, match="fewer than the stages"):
        pipeline_split(2, 3)


def test_spec_defaults_and_checks() -> None:
    spec = parse_parallel("pp=4")
    assert spec.pipelined and spec.n_microbatches == 4 and spec.schedule == "1f1b"
    with pytest.raises(UserInputError, match="--schedule"):
        ParallelSpec((("pp", 2),), schedule="zb")
    with pytest.raises(UserInputError, match="needs pp"):
        ParallelSpec((("ddp", 2),), microbatches=2)
    with pytest.raises(UserInputError, match="combinations"):
        parse_parallel("pp=2,ddp=2")


@pytest.mark.parametrize("optimizer, microbatches, schedule", [
    pytest.param(optimizer, microbatches, schedule, id=f"{optimizer}-{microbatches}-{schedule}",
                 marks=[pytest.mark.slow] if (optimizer, microbatches, schedule) == ("sgd", 4, "1f1b") else [])
    for optimizer in ("sgd", "adam") for microbatches in (2, 4) for schedule in ("gpipe", "1f1b")])
def test_every_stage_is_recorded_with_its_phases(schedule: str, microbatches: int, optimizer: str) -> None:
    spec = ParallelSpec((("pp", 2),), microbatches=microbatches, schedule=schedule)
    report = graphmem.analyze(**GPT, optimizer=optimizer, parallel=spec)
    assert report.train is not None
    ranks = {rank: group.report for group in report.train.ranks for rank in group.ranks}
    assert sorted(ranks) == [0, 1]
    assert {p.phase for p in ranks[0].phases} == {"forward", "backward", "optimizer"}  # no loss on stage 0
    assert {p.phase for p in ranks[1].phases} == {"forward", "loss", "backward", "optimizer"}
    # (not asserted: two analyses of the same job have been seen to differ by 4 bytes, one loss scalar)


def test_the_batch_must_split_into_the_microbatches() -> None:
    with pytest.raises(UserInputError, match="multiple of the microbatches"):
        graphmem.analyze(**{**GPT, "inputs": ["3x16:int64"]}, optimizer="sgd",
                         parallel=ParallelSpec((("pp", 2),), microbatches=2))


def test_inference_is_refused() -> None:
    with pytest.raises(UserInputError, match="training step only"):
        graphmem.analyze(**{**GPT, "mode": "inference"}, parallel="pp=2")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.slow
def test_every_rank_matches_real_execution(schedule: str) -> None:
    from tests.dist_oracles import measure_distributed

    measured = measure_distributed("tests.dist_oracles:small_gpt", ["4x16:int64"], strategy="pp", world_size=2,
                                   optimizer="adam", loss="cross_entropy", microbatches=2, schedule=schedule)
    report = graphmem.analyze(**GPT, optimizer="adam",
                              parallel=ParallelSpec((("pp", 2),), microbatches=2, schedule=schedule))
    assert report.train is not None
    predicted = {rank: g.report for g in report.train.ranks for rank in g.ranks}
    for m in measured:
        assert predicted[m.rank].peak_bytes == m.peak_bytes
        assert {p.phase: p.peak_bytes for p in predicted[m.rank].phases} == m.phase_peaks
