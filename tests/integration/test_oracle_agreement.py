"""graphmem's CPU prediction equals the real-execution oracle's peak, to the byte."""

from __future__ import annotations

import pytest

import graphmem
from tests.models import ZOO, CachedPositions, RealAttribute, ZooModel, cached_positions
from tests.oracles import OPTIMIZERS, measure_inference, measure_training, real_inputs


@pytest.mark.parametrize("model", ZOO, ids=lambda m: m.name)
def test_inference_peak_matches_real_execution(model: ZooModel) -> None:
    measured = measure_inference(model.build, real_inputs(model.inputs, model.int_high))
    predicted = graphmem.analyze(model.build, model.inputs, mode="inference")
    assert predicted.inference is not None
    assert predicted.inference.peak_bytes == measured.peak_bytes


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("model", ZOO, ids=lambda m: m.name)
def test_training_peak_matches_real_execution(model: ZooModel, optimizer: str) -> None:
    measured = measure_training(model.build, real_inputs(model.inputs, model.int_high),
                                OPTIMIZERS[optimizer], model.loss)
    predicted = graphmem.analyze(model.build, model.inputs, mode="train", optimizer=optimizer,
                                 loss=model.loss)
    assert predicted.train is not None
    assert predicted.train.peak_bytes == measured.peak_bytes
    phases = {p.phase: p.peak_bytes for p in predicted.train.phases}
    assert phases == measured.phase_peaks


def test_tensor_cached_by_model_code_across_recordings() -> None:
    """Model code that caches a tensor by shape hands the tensor made while recording inference
    to the training recording (and to the next analysis): both record, and training matches a
    real run that makes the tensor itself."""
    cached_positions.cache_clear()
    predicted = graphmem.analyze(CachedPositions, ["4x16x32"], mode="both", optimizer="adam")
    again = graphmem.analyze(CachedPositions, ["4x16x32"], mode="train", optimizer="adam")
    cached_positions.cache_clear()  # the real run makes its own
    measured = measure_training(CachedPositions, real_inputs(("4x16x32",), 100), OPTIMIZERS["adam"], "sum")
    cached_positions.cache_clear()
    assert predicted.train is not None and again.train is not None
    assert predicted.train.peak_bytes == again.train.peak_bytes == measured.peak_bytes


def test_real_tensor_attribute_becomes_a_fake_constant() -> None:
    """A real tensor the model holds outside its parameters and buffers is used as a fake
    constant: the step records, and training matches the real run."""
    predicted = graphmem.analyze(RealAttribute, ["8x16"], mode="train", optimizer="adam")
    measured = measure_training(RealAttribute, real_inputs(("8x16",), 100), OPTIMIZERS["adam"], "sum")
    assert predicted.train is not None and predicted.train.peak_bytes == measured.peak_bytes
