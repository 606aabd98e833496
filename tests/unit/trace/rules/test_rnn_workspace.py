"""The oneDNN LSTM workspace rule against the real CPU kernel, to the byte, and the
``output_shapes`` rule kind it uses."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphmem
from graphmem.trace.rules import rules_for
from graphmem.trace.rules.registry import ArgMeta, output_shapes, register
from graphmem.trace.rules.rnn import onednn_lstm_workspace_bytes

aten = torch.ops.aten
_LSTM = 2  # mkldnn_rnn_layer's mode for an LSTM (ideep::rnn_kind::LSTM)

# the tests that run the oneDNN kernel (the rule's registration and checks run without it)
onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


def _meta(t: Any) -> Any:
    return ArgMeta(tuple(t.shape), t.dtype, tuple(t.stride())) if isinstance(t, torch.Tensor) else t


def _layer_args(seq: int, batch: int, input_size: int, hidden: int, dtype: torch.dtype, *,
                bias: bool = True, reverse: bool = False) -> tuple[Any, ...]:
    """mkldnn_rnn_layer's arguments for one LSTM layer, as RNN.cpp's mkldnn_rnn passes them."""
    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)
    return (zeros(seq, batch, input_size), zeros(4 * hidden, input_size), zeros(4 * hidden, hidden),
            zeros(4 * hidden), zeros(4 * hidden), zeros(batch, hidden), zeros(batch, hidden),
            reverse, [], _LSTM, hidden, 1, bias, False, False, True)


def _predicted(args: tuple[Any, ...]) -> int:
    rule = rules_for("cpu").output_shapes[aten.mkldnn_rnn_layer.default]
    shapes = output_shapes(rule, tuple(_meta(a) for a in args), {})
    return shapes[3][0] if 3 in shapes else 0


# sequence length, batch, input size, hidden size: around oneDNN's 64-byte leading dimensions
# (1, 20, 40: padded; 64, 256: the +64 B bump at multiples of 256 elements) and its 4 KiB pages
_GRID = list(itertools.product((1, 7, 33), (1, 3, 16), (1, 24, 100, 256), (1, 20, 40, 64, 128, 256)))


@onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.slow
def test_workspace_matches_the_kernel_over_a_grid(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU runs no bf16 oneDNN LSTM")
    wrong = []
    for seq, batch, input_size, hidden in _GRID:
        args = _layer_args(seq, batch, input_size, hidden, dtype)
        real = aten.mkldnn_rnn_layer.default(*args)[3]
        assert real.dtype == torch.uint8
        if _predicted(args) != real.numel():
            wrong.append(((seq, batch, input_size, hidden), _predicted(args), real.numel()))
    assert not wrong, f"(T, N, I, H), predicted, real: {wrong}"


@onednn
@pytest.mark.parametrize("bias, reverse", [(False, False), (True, True)])
def test_workspace_ignores_bias_and_direction(bias: bool, reverse: bool) -> None:
    args = _layer_args(5, 3, 24, 40, torch.float32, bias=bias, reverse=reverse)
    assert _predicted(args) == aten.mkldnn_rnn_layer.default(*args)[3].numel() == \
        onednn_lstm_workspace_bytes(5, 3, 24, 40, 4, 4)


@onednn
def test_no_workspace_without_grad_mode() -> None:
    args = _layer_args(5, 3, 24, 40, torch.float32)
    with torch.no_grad():
        assert aten.mkldnn_rnn_layer.default(*args)[3] is None
        assert _predicted(args) == 0


class _Workspaces(TorchDispatchMode):
    """Each mkldnn_rnn_layer call of a real run: its arguments as metadata and its workspace's size."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[Any, ...], int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is aten.mkldnn_rnn_layer.default:
            self.calls.append((tuple(_meta(a) for a in args), out[3].numel()))
        return out


@onednn
@pytest.mark.parametrize("kwargs", [dict(num_layers=2), dict(bidirectional=True), dict(batch_first=True),
                                    dict(bias=False), dict(num_layers=2, bidirectional=True, batch_first=True)],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_every_layer_and_direction_of_nn_lstm(kwargs: dict[str, Any]) -> None:
    lstm = nn.LSTM(12, 20, **kwargs)
    x = torch.randn(4, 6, 12)
    with _Workspaces() as seen:
        lstm(x)[0].sum().backward()
    layers = kwargs.get("num_layers", 1) * (2 if kwargs.get("bidirectional") else 1)
    assert len(seen.calls) == layers
    rule = rules_for("cpu").output_shapes[aten.mkldnn_rnn_layer.default]
    for args, real in seen.calls:
        assert output_shapes(rule, args, {}) == {3: (real,)}


@pytest.mark.parametrize("module", [nn.GRU(12, 20), nn.LSTM(12, 20, proj_size=8)], ids=["gru", "lstm-proj"])
def test_gru_and_projected_lstm_do_not_run_onednn(module: nn.Module) -> None:
    """The rule covers every CPU recurrent layer that runs oneDNN: GRU and LSTM with proj_size
    take PyTorch's own kernels (RNN.cpp: only _VF.lstm without projections calls oneDNN)."""
    with _Workspaces() as seen, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "LSTM with projections is not supported with oneDNN"
        module(torch.randn(4, 6, 12))[0].sum().backward()
    assert seen.calls == []


class _SeqLSTM(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32, **kwargs: Any) -> None:
        super().__init__()
        self.rnn = nn.LSTM(12, 20, **kwargs).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@onednn
@pytest.mark.parametrize("dtype, kwargs, spec", [
    (torch.float32, dict(num_layers=2, bidirectional=True), "5x3x12"),
    (torch.bfloat16, dict(num_layers=2, batch_first=True, dropout=0.2), "3x5x12:bf16"),
], ids=["fp32-bidirectional", "bf16-batch-first"])
def test_training_peak_includes_the_workspaces(dtype: torch.dtype, kwargs: dict[str, Any], spec: str) -> None:
    """A workspace per layer and direction, held from the forward to the backward: the
    training peak equals the real run's, per phase too."""
    from tests.oracles import OPTIMIZERS, measure_training, real_inputs

    def build() -> nn.Module:
        return _SeqLSTM(dtype, **kwargs)
    measured = measure_training(build, real_inputs([spec], 10), OPTIMIZERS["sgd"], "sum")
    predicted = graphmem.analyze(build, [spec], mode="train", optimizer="sgd", loss="sum")
    assert predicted.train is not None
    assert predicted.train.peak_bytes == measured.peak_bytes
    assert {p.phase: p.peak_bytes for p in predicted.train.phases} == measured.phase_peaks


def test_output_shapes_kind_goes_through_register_only() -> None:
    @register(aten.mkldnn_rnn_layer.default, device="test-shapes", kind="output_shapes")
    def first(args: Any, kwargs: Any) -> dict[int, tuple[int, ...]]:
        return {3: (8,)}

    assert rules_for("test-shapes").output_shapes == {aten.mkldnn_rnn_layer.default: first}
    assert rules_for("test-shapes").scratch == {}
    with pytest.raises(ValueError, match="first.*second"):
        @register(aten.mkldnn_rnn_layer.default, device="test-shapes", kind="output_shapes")
        def second(args: Any, kwargs: Any) -> dict[int, tuple[int, ...]]:
            return {}


@pytest.mark.parametrize("answer", [{3: 8}, {3: (-1,)}, {"3": (8,)}, [(3, (8,))]], ids=str)
def test_output_shapes_answer_is_checked(answer: Any) -> None:
    with pytest.raises(AssertionError, match="output_shapes"):
        output_shapes(lambda args, kwargs: answer, (), {})
