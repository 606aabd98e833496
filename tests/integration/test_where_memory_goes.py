"""The "where the memory goes" outputs against the truth of a real CPU run.

  - top tensors: the storages a real run holds when it reaches its peak (a test-only
    LiveStorages that also keeps their sizes) are the ones graphmem lists, size for size;
  - the memory_viz snapshot's alloc/free events replay to the real peak;
  - per-module parameters, gradients and optimizer state equal what the real modules and
    the real torch.optim optimizer hold after a step, grouped by parameter name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import graphmem
from graphmem.memory.attribution import OPTIMIZER_STEP
from graphmem.memory.results import MemoryReport
from graphmem.report import build_snapshot, module_rows, top_tensors
from tests.models import ZOO, ZooModel
from tests.oracles import OPTIMIZERS, LiveStorages, real_inputs


class LiveAtPeak(LiveStorages):
    """LiveStorages that also keeps the sizes of the storages live when the peak is reached."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes_at_peak: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        before = self.peak
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.peak > before:  # the first op to reach a new peak, as graphmem's peak step
            self.sizes_at_peak = sorted((n for _, n in self.refs.values()), reverse=True)
        return out


def _loss(out: torch.Tensor, kind: str, targets: list[torch.Tensor]) -> torch.Tensor:
    if kind == "sum":
        return out.sum()
    if not targets:
        targets.append(torch.zeros(out.shape[:-1], dtype=torch.int64))
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets[0].reshape(-1))


def run_for_real(model: ZooModel, optimizer: str) -> tuple[LiveAtPeak, torch.nn.Module, torch.optim.Optimizer]:
    """Two iterations of the step graphmem records (tests/oracles.py), on real CPU tensors."""
    torch.manual_seed(0)
    net = model.build()
    net.train()
    inputs = real_inputs(model.inputs, model.int_high)
    opt = OPTIMIZERS[optimizer]([p for p in net.parameters() if p.requires_grad])
    counter = LiveAtPeak()
    for t in [*net.parameters(), *net.buffers(), *inputs]:
        counter.add(t)
    targets: list[torch.Tensor] = []

    def step() -> None:  # out and the loss die when it returns
        out = net(*inputs)
        value = _loss(out, model.loss, targets)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with counter:
        for _ in range(2):
            step()
    return counter, net, opt


# an MLP (Adam's temporaries make the peak), a GPT (tied embedding, attention, cross-entropy),
# a ResNet (BatchNorm buffers, in-place ReLU) with SGD
CASES = [(next(m for m in ZOO if m.name == name), opt) for name, opt in
         (("mlp", "adam"), ("gpt", "adam"), ("resnet", "sgd"))]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0].name}-{c[1]}")
def measured(request: pytest.FixtureRequest) -> tuple[ZooModel, str, LiveAtPeak, torch.nn.Module,
                                                        torch.optim.Optimizer, MemoryReport]:
    model, optimizer = request.param
    if model.loss not in ("sum", "cross_entropy"):
        pytest.skip(f"the runner here knows sum and cross_entropy, not {model.loss}")
    counter, net, opt = run_for_real(model, optimizer)
    report = graphmem.analyze(model.build, model.inputs, mode="train", optimizer=optimizer, loss=model.loss)
    return model, optimizer, counter, net, opt, report


def test_top_tensors_are_the_real_largest_at_the_peak(measured: tuple[Any, ...]) -> None:
    _, _, counter, _, _, report = measured
    assert report.train.peak_bytes == counter.peak
    predicted = [t.nbytes for t in top_tensors(report.train, 10_000)]
    assert predicted[:10] == counter.sizes_at_peak[:10]
    assert sorted(predicted, reverse=True) == counter.sizes_at_peak  # the whole live set, size for size


def test_snapshot_replays_to_the_real_peak(measured: tuple[Any, ...]) -> None:
    _, _, counter, _, _, report = measured
    live = peak = 0
    for entry in build_snapshot(report.train)["device_traces"][0]:
        if entry["action"] == "alloc":
            live += entry["size"]
            peak = max(peak, live)
        elif entry["action"] == "free_completed":
            live -= entry["size"]
    assert peak == counter.peak


def _by_module(named: list[tuple[str, int]], depth: int) -> dict[str, int]:
    """Bytes per module path cut at ``depth``, from parameter names ("a.b.weight" -> "a.b")."""
    out: dict[str, int] = {}
    for name, nbytes in named:
        key = ".".join(name.split(".")[:-1][:depth]) or "(root)"
        out[key] = out.get(key, 0) + nbytes
    return out


def _nonzero(rows: tuple[Any, ...], field: str) -> dict[str, int]:
    return {r.module: getattr(r, field) for r in rows if getattr(r, field)}


def test_module_columns_match_the_real_modules_and_optimizer(measured: tuple[Any, ...]) -> None:
    _, _, _, net, opt, report = measured
    named = [(n, p.untyped_storage().nbytes()) for n, p in net.named_parameters()]
    state: Callable[[torch.nn.Parameter], int] = lambda p: sum(
        v.untyped_storage().nbytes() for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor))
    for depth in (1, 2):
        rows = module_rows(report.train, depth)
        assert _nonzero(rows, "params_bytes") == _by_module(named, depth)
        assert _nonzero(rows, "grads_bytes") == _by_module(named, depth)  # a gradient per parameter
        real_state = sum(state(p) for p in net.parameters())  # charged to the optimizer step, not a module
        assert _nonzero(rows, "optimizer_state_bytes") == ({OPTIMIZER_STEP: real_state} if real_state else {})
