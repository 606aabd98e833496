"""Value-dependent models are analysed as upper bounds, checked against real CPU runs: an input
that keeps every element reaches the bound to the byte; random inputs stay at or below it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphmem
from tests.oracles import OPTIMIZERS, measure_inference, measure_training
from tests.value_models import LoopMoE, PredictedLength, RandomCrop, RowGate, SampledPositives, Sampler, Selects

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


@pytest.mark.parametrize("build", [RowGate, Selects, LoopMoE, Sampler, SampledPositives], ids=lambda b: b.__name__)
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


def test_a_mask_set_from_zeros_is_bounded_by_what_was_set() -> None:
    """Sampler's head runs on at most 16 of the 64 rows, whatever the scores, and the bound
    counts 16, not every row: above a real run only by the one index list too many (the
    positive and the negative rows are each bounded by all 64; together they are 64, int64)."""
    report = _predicted(Sampler)
    for seed in range(3):
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
        inference, train = _measured(Sampler, x)
        for predicted, real in ((report.inference.peak_bytes, inference), (report.train.peak_bytes, train)):
            assert real <= predicted <= real + SHAPE[0] * 8, (seed, predicted, real)
    assert any("recorded keeping 16 elements" in a for a in report.train.assumptions)


def test_the_sampled_rows_labelled_positive_are_at_most_the_samplers_positives() -> None:
    """SampledPositives' mask head runs on the sampled rows whose label is > 0: of the 16 sampled
    rows, those can only be the at most 4 taken from the rows labelled >= 1 (the others were
    taken from rows labelled 0), and the bound counts 4, not 16.  Training: to the byte; inference
    above only by the index lists of all positive and all negative rows (each bounded by 64)."""
    report = _predicted(SampledPositives)
    for seed in range(3):
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
        inference, train = _measured(SampledPositives, x)
        assert report.train.peak_bytes == train, (seed, report.train.peak_bytes, train)
        assert inference <= report.inference.peak_bytes <= inference + 2 * SHAPE[0] * 8, (seed, inference)
    assert any("recorded keeping 4 elements" in a for a in report.train.assumptions)


def test_labels_written_after_sampling_are_not_taken_as_sampled() -> None:
    """The same model relabelling every row positive after sampling: all 16 sampled rows reach
    the mask head, and the bound (which no longer takes the labels as sampled) covers them."""
    build = functools.partial(SampledPositives, relabel=True)
    report = _predicted(build)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    inference, train = _measured(build, x)
    assert inference <= report.inference.peak_bytes and train <= report.train.peak_bytes
    assert not any("recorded keeping 4 elements" in a for a in report.train.assumptions)


def test_a_random_choice_takes_its_last_option() -> None:
    """A uniform_ draw read as a choice is taken at its largest value: the last (here the
    longest) option, never below a real run of any of the three."""
    report = _predicted(RandomCrop)
    x = torch.randn(SHAPE)
    peaks = set()
    original = torch.Tensor.uniform_
    for index in range(3):  # each real run drawing the value that picks option ``index``
        torch.Tensor.uniform_ = lambda self, *a, i=index, **k: self.fill_(float(i))  # type: ignore[method-assign]
        try:
            inference, train = _measured(RandomCrop, x)
        finally:
            torch.Tensor.uniform_ = original  # type: ignore[method-assign]
        peaks.add((inference, train))
        assert inference <= report.inference.peak_bytes and train <= report.train.peak_bytes
    assert (report.inference.peak_bytes, report.train.peak_bytes) == max(peaks)
    assert any("random draw" in a for a in report.train.assumptions)


def test_a_predicted_length_declared_with_reads_matches_a_real_run_of_that_length() -> None:
    """PredictedLength reads how many frames its activations ask for: refused with the way out
    named, then, with that number declared (the real run's, from the same weights), exact."""
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    with pytest.raises(graphmem.TraceError, match="--assume reads=N"):
        graphmem.analyze(PredictedLength, [f"{SHAPE[0]}x{SHAPE[1]}"], loss="sum", optimizer="adam")
    torch.manual_seed(0)  # the weights the oracle's runs build
    real_model = PredictedLength()
    real_model(x)
    assert real_model.total > SHAPE[0]  # rows repeated: the length is the model's own
    report = _predicted(PredictedLength, assume={"reads": str(real_model.total)})
    assert (report.inference.peak_bytes, report.train.peak_bytes) == _measured(PredictedLength, x)
    notes = [a for a in report.train.assumptions if "--assume reads=" in a]
    assert any(f"read as {real_model.total}" in a for a in notes), notes
    assert any(f"repeating to {real_model.total} elements" in a for a in notes), notes
