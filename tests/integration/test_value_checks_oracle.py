"""Checks a model makes on its own values, answered as a healthy run answers them, give the
prediction of real CPU execution to the byte, and say so in the report: NaN / inf checks
(``if not torch.isfinite(h).all()``, Mask2Former; ``assert h.isnan().sum() == 0``, I-BERT) and
``torch._check_tensor_all`` assertions (VITS, through transformers' torch_compilable_check)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphmem
from tests.oracles import OPTIMIZERS, measure_inference, measure_training


class Checked(nn.Module):
    def __init__(self, check: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 8)
        self.check = check

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.check == "isfinite":
            if not torch.isfinite(h).all():
                h = torch.clamp(h, min=-1e30, max=1e30)
        elif self.check == "isnan":
            assert h.isnan().sum() == 0 and not h.isinf().any(), "NaN in the hidden states"
        else:
            torch._check_tensor_all_with(ValueError, h >= 0, "negative after relu")
        return self.fc2(h)


@pytest.mark.parametrize("check", ["isfinite", "isnan", "assertion"])
def test_value_checks_are_answered_as_a_healthy_run(check: str) -> None:
    build = lambda: Checked(check)
    inputs = [torch.randn(16, 32)]
    report = graphmem.analyze(build, ["16x32"], mode="both", optimizer="adam", loss="sum")
    assert report.inference is not None and report.train is not None
    assert report.inference.peak_bytes == measure_inference(build, inputs).peak_bytes
    assert report.train.peak_bytes == measure_training(build, inputs, OPTIMIZERS["adam"], "sum").peak_bytes
    words = "NaN or inf" if check != "assertion" else "asserts a condition"
    assert any(words in note for note in report.train.assumptions), report.train.assumptions
