"""Values a model computes when it is built and its forward reads (EnCodec's convolutions keep
stride, kernel size and padding as one-element buffers and pad by them) answer those reads:
the prediction equals real CPU execution to the byte, and the report says so.  A value drawn at
random when built is known to no one and is still refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import graphmem
from graphmem.errors import TraceError
from tests.coverage_sweep import coverage_sweep
from tests.oracles import OPTIMIZERS, measure_inference, measure_training
from tests.value_models import PaddedConv, RandomBuffer


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_buffers_computed_when_built_answer_the_reads(dtype: str | None) -> None:
    report = graphmem.analyze(PaddedConv, ["2x4x45" + (f":{dtype}" if dtype else "")], mode="both",
                              optimizer="adam", loss="sum", dtype=dtype)
    assert report.inference is not None and report.train is not None
    real_dtype = getattr(torch, dtype) if dtype else torch.float32

    def build() -> Any:
        return PaddedConv().to(real_dtype)

    x = torch.randn(2, 4, 45, dtype=real_dtype)
    assert report.inference.peak_bytes == measure_inference(build, [x]).peak_bytes
    assert report.train.peak_bytes == measure_training(build, [x], OPTIMIZERS["adam"], "sum").peak_bytes
    assert any("values of its buffers" in note for note in report.train.assumptions), report.train.assumptions


@pytest.mark.parametrize("how", ["rand", "uniform_"])
def test_a_buffer_drawn_at_random_is_not_answered(how: str) -> None:
    with pytest.raises(TraceError, match="reads a tensor's value"):
        graphmem.analyze(lambda: RandomBuffer(how), ["4x8"], mode="inference")


def test_a_users_model_with_real_buffers_is_answered_and_left_unchanged() -> None:
    model = PaddedConv()
    before = {name: b.clone() for name, b in model.named_buffers()}
    report = graphmem.analyze(model, ["2x4x45"], mode="inference")
    assert report.inference is not None
    assert report.inference.peak_bytes == measure_inference(PaddedConv, [torch.randn(2, 4, 45)]).peak_bytes
    assert all(torch.equal(before[name], b) for name, b in model.named_buffers())


@pytest.mark.parametrize("model_type", ["encodec", "mimi_encoder"])
def test_transformers_audio_codecs_match_real_execution(model_type: str) -> None:
    sweep = coverage_sweep()  # skips where transformers is missing
    config = sweep.small_config(model_type)
    cls, task, _ = sweep.first_buildable(config, sweep.candidate_classes(model_type))

    def build() -> Any:
        return cls(copy.deepcopy(config))

    for mode in ("inference", "train"):
        variants = sweep.input_variants(cls, config, task, mode)
        real = sweep._real_row(build, mode, variants)  # the first variant the model runs on
        assert real["status"] == "measured", real
        sweep._clear_caches()
        assert sweep.predict(build, mode, variants[real["variant"]]) == real["measured"], mode
