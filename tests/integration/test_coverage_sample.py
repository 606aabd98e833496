"""A fixed sample of the coverage sweep (benchmarks/coverage.py, docs/coverage.md), against real
CPU execution: one architecture of each kind, built from its shrunk config as the sweep builds it,
with the inputs the sweep derives, in inference and in a training step (SGD, the model's own loss).
"""

from __future__ import annotations

import copy

import pytest

from tests.coverage_sweep import coverage_sweep

# kind -> model type: a seq2seq LM, a CNN, a windowed vision transformer, a speech seq2seq
# model, a state-space LM, a masked LM with relative attention, a mixture-of-experts LM, a CTC
# speech recognizer (its masks and loss sized from known values), a vision transformer whose
# position-embedding gradient layout follows size-1 view strides
SAMPLE = {
    "seq2seq": "bart",
    "cnn": "resnet",
    "windowed-vision": "swin",
    "speech": "whisper",
    "state-space": "mamba",
    "masked-lm": "deberta-v2",
    "moe": "qwen2_moe",
    "ctc": "wav2vec2",
    "size-1-strides": "radio",
}


@pytest.mark.parametrize("mode", ["inference", "train"])
@pytest.mark.parametrize("model_type", SAMPLE.values(), ids=SAMPLE.keys())
def test_sample_architecture_matches_real_execution(model_type: str, mode: str) -> None:
    sweep = coverage_sweep()  # skips where transformers is missing
    config = sweep.small_config(model_type)
    cls, task, params = sweep.first_buildable(config, sweep.candidate_classes(model_type))
    assert params <= sweep.MAX_PARAMS

    def build() -> object:
        return cls(copy.deepcopy(config))

    inputs = sweep.input_variants(cls, config, task, mode)[0]
    measured = sweep.measure(build, mode, inputs)
    assert sweep.predict(build, mode, inputs) == measured
