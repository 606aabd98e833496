"""Hand arithmetic on tiny models: every expected int is derived in the comment beside it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import graphmem


class KeepsLocals(nn.Module):
    """Linear(4,8) -> relu -> Linear(8,2), no biases, with `a` held as a local to the end."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 8, bias=False)
        self.l2 = nn.Linear(8, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.l1(x)
        b = F.relu(a)
        return self.l2(b)


def test_single_linear_inference() -> None:
    # weight 3x4 fp32 = 48 B, input 2x4 = 32 B, output 2x3 = 24 B; t() is a view (0 B)
    report = graphmem.analyze(lambda: nn.Linear(4, 3, bias=False), ["2x4"], mode="inference")
    assert report.inference is not None
    assert report.inference.peak_bytes == 48 + 32 + 24


def test_sequential_frees_intermediate_after_next_layer() -> None:
    # params 4*8*4 + 8*2*4 = 192 B, input 32 B; after relu: h1 (2x8 = 64 B) and relu out (64 B)
    # are both live: 192 + 32 + 64 + 64 = 352 B.  Sequential drops h1 before l2 runs.
    model = lambda: nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(), nn.Linear(8, 2, bias=False))
    report = graphmem.analyze(model, ["2x4"], mode="inference")
    assert report.inference is not None
    assert report.inference.peak_bytes == 352
    # after l2: h1 gone, relu out 64 B and output 2x2 = 16 B: 192 + 32 + 64 + 16 = 304 B
    assert report.inference.timeline[-1] == 304


def test_locals_are_held_until_return_but_not_under_last_use() -> None:
    # observed: `a` stays referenced until forward returns, so at l2's mm
    # 192 + 32 + a 64 + b 64 + out 16 = 368 B
    observed = graphmem.analyze(KeepsLocals, ["2x4"], mode="inference")
    assert observed.inference is not None
    assert observed.inference.peak_bytes == 368
    # last_use: `a` dies after relu; peak is at relu, 192 + 32 + 64 + 64 = 352 B
    eager = graphmem.analyze(KeepsLocals, ["2x4"], mode="inference", policy="last_use")
    assert eager.inference is not None
    assert eager.inference.peak_bytes == 352


def test_tied_weights_count_once() -> None:
    # two Linear(16,16) sharing one 16x16 fp32 weight: 1024 B once, not 2048 B
    def tied() -> nn.Module:
        model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False))
        model[1].weight = model[0].weight
        return model

    report = graphmem.analyze(tied, ["1x16"], mode="inference")
    assert report.inference is not None
    assert report.inference.params_bytes == 1024


def test_in_place_relu_adds_no_storage() -> None:
    # Linear(4,8) no bias: 128 B weight, 32 B input, 64 B output; ReLU(inplace) reuses it
    model = lambda: nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(inplace=True))
    report = graphmem.analyze(model, ["2x4"], mode="inference")
    assert report.inference is not None
    assert report.inference.peak_bytes == 128 + 32 + 64
