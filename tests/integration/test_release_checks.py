"""Releases found through tensors' weak-reference callbacks (the default: cost linear in the
number of ops) equal releases found by checking every live storage after every op
(GRAPHMEM_CHECK_EVERY_STORAGE=1), storage by storage, on the zoo, checkpointing, generation
and sharded training."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

import graphmem
from tests.models import ZOO, CheckpointedMLP, UnusedHead
from tests.oracles import OPTIMIZERS, measure_training, real_inputs
from tests.parallel_cases import CASES


def _storages(monkeypatch: pytest.MonkeyPatch, check_all: bool, **keywords: Any) -> list[Any]:
    if check_all:
        monkeypatch.setenv("GRAPHMEM_CHECK_EVERY_STORAGE", "1")
    else:
        monkeypatch.delenv("GRAPHMEM_CHECK_EVERY_STORAGE", raising=False)
    report = graphmem.analyze(**keywords)
    modes = [m for m in (report.inference, report.train) if m is not None]
    return [(rank.report.trace.storages if hasattr(rank, "report") else rank.trace.storages)
            for m in modes for rank in (m.ranks or (m,))]


def _same(monkeypatch: pytest.MonkeyPatch, **keywords: Any) -> None:
    assert _storages(monkeypatch, False, **keywords) == _storages(monkeypatch, True, **keywords)


@pytest.mark.parametrize("model", ZOO, ids=lambda m: m.name)
def test_zoo_releases_equal_checking_every_storage(monkeypatch: pytest.MonkeyPatch, model: Any) -> None:
    _same(monkeypatch, model=model.build, inputs=list(model.inputs), loss=model.loss)


def test_checkpointing_releases_equal_checking_every_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    _same(monkeypatch, model=CheckpointedMLP, inputs=["8x128"], mode="train", checkpoint=["Linear"])


def test_unused_output_branch_released_with_its_saved_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A storage whose last holder is the copy saved for backward (an output branch the loss
    does not use) is released when that copy dies, as in the real run."""
    _same(monkeypatch, model=UnusedHead, inputs=["8x16x64"], mode="train", optimizer="sgd")
    measured = measure_training(UnusedHead, real_inputs(("8x16x64",), 100), OPTIMIZERS["sgd"], "sum")
    predicted = graphmem.analyze(UnusedHead, ["8x16x64"], mode="train", optimizer="sgd")
    assert predicted.train is not None
    assert predicted.train.peak_bytes == measured.peak_bytes


@pytest.mark.parametrize("case", [c for c in CASES if c.world_size == 2 and not c.options][:6], ids=lambda c: c.name)
def test_sharded_releases_equal_checking_every_storage(monkeypatch: pytest.MonkeyPatch, case: Any) -> None:
    _same(monkeypatch, **case.graphmem_keywords())


def test_ten_thousand_layers_record() -> None:
    """Deep stacks record: release checks no longer grow with the number of live storages
    (benchmarks/bench_depth.py measures the time)."""
    model = nn.Sequential(*[nn.ReLU() for _ in range(10_000)])
    report = graphmem.analyze(model, ["4x8"], mode="inference")
    assert report.inference is not None
    assert len(report.inference.trace.ops) == 10_000
