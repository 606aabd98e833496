"""Value-dependent models are analysed as upper bounds, checked against real CPU runs: an input
that keeps every element reaches the bound to the byte; random inputs stay at or below it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphmem
from tests.oracles import OPTIMIZERS, measure_inference, measure_training
from tests.value_models import LoopMoE, RowGate, Selects

SHAPE = (64, 32)


def _predicted(build: Callable[[], Any], **keywords: Any) -> Any:
    report = graphmem.analyze(build, [f"{SHAPE[0]}x{SHAPE[1]}"], loss="sum", optimizer="adam", **keywords)
    assert report.train is not None and report.inference is not None
    return report


def _measured(build: Callable[[], Any], x: torch.Tensor) -> tuple[int, int]:
    train = measure_training(build, [x], OPTIMIZERS["adam"], "sum")
    return measure_inference(build, [x]).peak_bytes, train.peak_bytes


@pytest.mark.parametrize("build", [RowGate, Selects], ids=lambda b: b.__name__)
def test_an_input_keeping_every_element_reaches_the_bound(build: Callable[[], Any]) -> None:
    report = _predicted(build)
    x = torch.arange(1, SHAPE[0] * SHAPE[1] + 1, dtype=torch.float32).reshape(SHAPE)  # positive, distinct
    inference, train = _measured(build, x)
    assert (report.inference.peak_bytes, report.train.peak_bytes) == (inference, train)
    assert any("upper bound" in a for a in report.train.assumptions)


@pytest.mark.parametrize("build", [RowGate, Selects, LoopMoE], ids=lambda b: b.__name__)
def test_random_inputs_stay_within_the_bound(build: Callable[[], Any]) -> None:
    report = _predicted(build)
    for seed in range(3):
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
        inference, train = _measured(build, x)
        assert inference <= report.inference.peak_bytes and train <= report.train.peak_bytes, (seed, inference, train)


def test_a_declared_fraction_is_noted_and_lowers_the_bound() -> None:
    full = _predicted(RowGate)
    half = _predicted(RowGate, assume={"nonzero": "0.5"})
    assert half.train.peak_bytes < full.train.peak_bytes
    assert any("as declared with --assume nonzero=0.5" in a for a in half.train.assumptions)
    x = torch.cat([torch.ones(SHAPE[0] // 2, SHAPE[1]), -torch.ones(SHAPE[0] // 2, SHAPE[1])])  # half the rows kept
    inference, train = _measured(RowGate, x)
    assert (half.inference.peak_bytes, half.train.peak_bytes) == (inference, train)
