"""A forward that converts a submodule to the dtype it already has (transformers'
SwitchTransformers router: ``self.classifier = self.classifier.to(self.dtype)``) records, and
its prediction equals real CPU execution to the byte, in inference and training."""

from __future__ import annotations

import torch
from torch import nn

import graphmem
from tests.oracles import OPTIMIZERS, measure_inference, measure_training


class ConvertsInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(32, 8)
        self.out = nn.Linear(8, 4)
        self.dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.router = self.router.to(self.dtype)
        return self.out(torch.relu(self.router(x)))


def test_a_conversion_to_the_same_dtype_in_forward_is_recorded_as_it_runs() -> None:
    inputs = [torch.randn(16, 32)]
    report = graphmem.analyze(ConvertsInForward, ["16x32"], mode="both", optimizer="adam", loss="sum")
    assert report.inference is not None and report.train is not None
    assert report.inference.peak_bytes == measure_inference(ConvertsInForward, inputs).peak_bytes
    assert report.train.peak_bytes == measure_training(ConvertsInForward, inputs, OPTIMIZERS["adam"], "sum").peak_bytes
