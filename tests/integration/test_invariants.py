"""Invariants on every result, category sums against independent counts, differential checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphmem
from graphmem import Category
from tests.models import ZOO, ZooModel


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


@pytest.fixture(scope="module", params=ZOO, ids=lambda m: m.name)
def analysed(request: pytest.FixtureRequest) -> tuple[ZooModel, graphmem.MemoryReport]:
    model: ZooModel = request.param
    return model, graphmem.analyze(model.build, model.inputs, loss=model.loss, optimizer="adam")


def test_invariants(analysed: tuple[ZooModel, graphmem.MemoryReport]) -> None:
    _, report = analysed
    for mode in (report.inference, report.train):
        assert mode is not None
        assert min(mode.timeline) >= 0
        assert max(mode.timeline) == mode.peak_bytes
        assert sum(mode.breakdown.values()) == mode.peak_bytes
        assert mode.peak_bytes >= mode.params_bytes + mode.buffers_bytes + mode.inputs_bytes
        assert all(p.peak_bytes <= mode.peak_bytes for p in mode.phases)
    assert report.train.peak_bytes >= report.inference.peak_bytes  # type: ignore[union-attr]


def test_categories_match_independent_sums(analysed: tuple[ZooModel, graphmem.MemoryReport]) -> None:
    model, report = analysed
    real = model.build()
    params = [p for p in real.parameters()]  # .parameters() already de-duplicates tied weights
    param_bytes = _unique_bytes(params)
    train = report.train
    assert train is not None
    assert train.params_bytes == param_bytes
    assert train.buffers_bytes == _unique_bytes(list(real.buffers()))
    assert train.grads_bytes == param_bytes  # one gradient per trainable parameter
    # Adam: exp_avg and exp_avg_sq per parameter (2N) plus a float32 scalar `step` each
    assert train.optimizer_state_bytes == 2 * param_bytes + 4 * len(params)


@pytest.mark.parametrize("optimizer, state", [("sgd", lambda n, k: 0),
                                              ("sgd-momentum", lambda n, k: n),
                                              ("adamw", lambda n, k: 2 * n + 4 * k)])
def test_optimizer_state_sizes(optimizer: str, state: object) -> None:
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    n = _unique_bytes(list(model.parameters()))
    report = graphmem.analyze(lambda: nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)),
                              ["4x64"], mode="train", optimizer=optimizer)
    assert report.train is not None
    assert report.train.optimizer_state_bytes == state(n, 4)  # type: ignore[operator]


def test_peak_grows_with_batch() -> None:
    peaks = []
    for batch in (1, 2, 4, 8, 16):
        report = graphmem.analyze(ZOO[0].build, [f"{batch}x1000"])
        assert report.train is not None and report.inference is not None
        peaks.append((report.inference.peak_bytes, report.train.peak_bytes))
    assert peaks == sorted(peaks)


class _ChainedLayers(nn.Module):
    """The MLP's math written without nn.Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(1000, 500)
        self.b = nn.Linear(500, 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        x = torch.relu(x)
        return self.b(x)


def test_same_math_in_another_structure_gives_the_same_peak() -> None:
    sequential = graphmem.analyze(ZOO[0].build, ["16x1000"])
    chained = graphmem.analyze(_ChainedLayers, ["16x1000"])
    assert sequential.train is not None and chained.train is not None
    assert sequential.inference is not None and chained.inference is not None
    assert sequential.inference.peak_bytes == chained.inference.peak_bytes
    assert sequential.train.peak_bytes == chained.train.peak_bytes


def test_activations_are_saved_tensors_only() -> None:
    # MLP forward saves x (input, counted as input), relu's output (16x500 fp32 = 32000 B)
    # for the second linear and threshold_backward; addmm's output before relu is not saved.
    report = graphmem.analyze(ZOO[0].build, ["16x1000"], mode="train", optimizer="sgd")
    assert report.train is not None
    assert report.train.activations_bytes == 16 * 500 * 4
    assert report.train.breakdown[Category.PARAMETER] == (1000 * 500 + 500 + 500 * 100 + 100) * 4


def test_a_module_instance_is_analysed_and_left_untouched() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    objects = {name: p for name, p in model.named_parameters()}
    report = graphmem.analyze(model, ["2x16:bf16"], dtype=torch.bfloat16)  # real PyTorch refuses fp32 inputs
    assert report.train is not None
    # bf16 weights: (16*8 + 8 + 8*4 + 4) * 2 bytes, as model.to(torch.bfloat16) would hold
    assert report.train.params_bytes == (16 * 8 + 8 + 8 * 4 + 4) * 2
    for name, p in model.named_parameters():
        assert p is objects[name] and p.dtype == torch.float32 and p.grad is None
        assert torch.equal(p, before[name])
