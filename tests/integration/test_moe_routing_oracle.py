"""Routing made from values graphmem does not have (an MoE router's torch.topk or argmax of its
scores) is taken as ``--assume routing`` says: ``uneven`` (the default: every expert picked once,
the first ones taking all the rest) or ``balanced``.  Checked against real CPU runs forced to
route the same way (tests.value_models.ForcedRouting), to the byte: our own experts written as
a loop that reads expert indices, as a split by sizes read with ``.tolist()``, and transformers'
JetMoE, GPT-OSS-style (OpenAI privacy filter) and SwitchTransformers experts as the coverage
sweep builds them."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import graphmem
from graphmem.errors import UserInputError
from graphmem.job.spec import parse_assumption
from tests.coverage_sweep import coverage_sweep
from tests.oracles import OPTIMIZERS, measure_inference, measure_training
from tests.value_models import ExpertLoop, ForcedRouting, SplitMoE

ROUTINGS = ["uneven", "balanced"]


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("build", [ExpertLoop, SplitMoE], ids=lambda b: b.__name__)
def test_our_experts_match_a_run_routed_the_same_way(build: Callable[[], Any], routing: str) -> None:
    report = graphmem.analyze(build, ["48x32"], mode="both", optimizer="adam", loss="sum",
                              assume={"routing": routing})
    assert report.inference is not None and report.train is not None
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
    with ForcedRouting(routing):
        inference = measure_inference(build, [x]).peak_bytes
        train = measure_training(build, [x], OPTIMIZERS["adam"], "sum").peak_bytes
    assert (report.inference.peak_bytes, report.train.peak_bytes) == (inference, train)
    words = "spread evenly, as declared" if routing == "balanced" else "taken as uneven as can be"
    assert any(words in note for note in report.train.assumptions), report.train.assumptions


def test_uneven_is_the_default_and_balanced_differs() -> None:
    default = graphmem.analyze(ExpertLoop, ["48x32"], mode="inference")
    uneven = graphmem.analyze(ExpertLoop, ["48x32"], mode="inference", assume={"routing": "uneven"})
    balanced = graphmem.analyze(ExpertLoop, ["48x32"], mode="inference", assume={"routing": "balanced"})
    assert default.inference is not None and uneven.inference is not None and balanced.inference is not None
    assert default.inference.peak_bytes == uneven.inference.peak_bytes != balanced.inference.peak_bytes


def test_a_malformed_routing_names_the_choices() -> None:
    with pytest.raises(UserInputError, match="routing=uneven .* or routing=balanced"):
        parse_assumption("routing=sideways")
    assert parse_assumption("routing=Balanced") == ("routing", "balanced")


# model type -> the modes whose real run the sweep's inputs allow
TRANSFORMERS = {"jetmoe": ("inference", "train"), "openai_privacy_filter": ("inference", "train"),
                "switch_transformers": ("inference",)}


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("model_type", TRANSFORMERS)
def test_transformers_experts_match_a_run_routed_the_same_way(model_type: str, routing: str) -> None:
    sweep = coverage_sweep()  # skips where transformers is missing
    config = sweep.small_config(model_type)
    cls, task, _ = sweep.first_buildable(config, sweep.candidate_classes(model_type))

    def build() -> Any:
        return cls(copy.deepcopy(config))

    for mode in TRANSFORMERS[model_type]:
        inputs = sweep.input_variants(cls, config, task, mode)[0]
        with ForcedRouting(routing):
            measured = sweep.measure(build, mode, inputs)
        sweep._clear_caches()
        keywords: dict[str, Any] = dict(optimizer="sgd", loss="auto") if mode == "train" else {}
        report = graphmem.analyze(build, [i.spec for i in inputs], mode=mode, assume={"routing": routing},
                                  **keywords)
        predicted = report.train if mode == "train" else report.inference
        assert predicted is not None and predicted.peak_bytes == measured, (mode, predicted.peak_bytes, measured)
