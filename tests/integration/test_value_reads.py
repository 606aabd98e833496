"""Models that read input-derived values: answered from the declared assumptions, and the
prediction equals a real run whose inputs hold those values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphmem
from graphmem.errors import TraceError, UserInputError
from tests.oracles import OPTIMIZERS, measure_inference, measure_training


class ReadsMask(nn.Module):
    """Branches on a mask, takes a value-dependent shape from it and reads a count."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if not mask.all():  # padding: a real model would zero the padded positions
            h = h * mask.unsqueeze(-1)
        keep = mask[0].nonzero()[:, 0]  # positions to keep: value-dependent shape
        scale = float(mask.sum().item())
        return self.head(h[:, keep]) * scale


class ReadsActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if self.fc(x).sum() > 0 else x


@pytest.mark.parametrize("kind, real", [("ones", torch.ones), ("zeros", torch.zeros)])
def test_mask_reads_match_a_real_run_with_that_mask(kind: str, real: object) -> None:
    ids = torch.randint(0, 100, (2, 8))
    mask = real((2, 8), dtype=torch.int64)  # type: ignore[operator]
    specs = ["2x8:int64", "2x8:int64"]
    assume = {"input_1": kind}
    inference = graphmem.analyze(ReadsMask, specs, mode="inference", assume=assume).inference
    assert inference is not None
    assert inference.peak_bytes == measure_inference(ReadsMask, [ids, mask]).peak_bytes
    train = graphmem.analyze(ReadsMask, specs, mode="train", optimizer="adam", assume=assume).train
    assert train is not None
    assert train.peak_bytes == measure_training(ReadsMask, [ids, mask], OPTIMIZERS["adam"], "sum").peak_bytes
    assert any("input_1 assumed" in note for note in train.assumptions)


def test_named_mask_defaults_to_ones_and_is_reported() -> None:
    report = graphmem.analyze(ReadsMask, ["ids=2x8:int64", "mask=2x8:int64"], mode="inference")
    assert report.inference is not None
    assert report.inference.assumptions == (
        "input mask assumed all ones (no padding) by default, to answer a value the model reads",)


def test_reads_of_activations_still_stop_with_a_clear_error() -> None:
    with pytest.raises(TraceError, match="reads a tensor's value"):
        graphmem.analyze(ReadsActivation, ["2x4"], mode="inference")


def test_assume_must_name_an_input() -> None:
    with pytest.raises(UserInputError, match="not an input"):
        graphmem.analyze(ReadsMask, ["ids=2x8:int64", "mask=2x8:int64"], assume={"masks": "ones"})


class WritesAConstant(nn.Module):
    """The wav2vec2 family's feature-vector mask: a Python constant written into a tensor
    (``mask[idx] = 1``), then the model branches on the result and sizes a tensor by it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        lengths = attention_mask.sum(-1) // 2
        frames = torch.zeros(x.shape[0], x.shape[1], dtype=attention_mask.dtype)
        frames[(torch.arange(x.shape[0]), lengths - 1)] = 1
        frames = frames.flip([-1]).cumsum(-1).flip([-1]).bool()
        h = self.fc(x)
        if not frames.all():  # padded frames are zeroed, as the encoder does
            h = h * frames.unsqueeze(-1)
        return h[:, : int(lengths.max())]


def test_a_constant_written_into_a_mask_keeps_its_value_known() -> None:
    x, mask = torch.randn(2, 6, 8), torch.ones(2, 12, dtype=torch.int64)
    specs = ["2x6x8", "attention_mask=2x12:int64"]
    report = graphmem.analyze(WritesAConstant, specs, mode="both", optimizer="adam")
    assert report.inference is not None and report.train is not None
    kw = {"attention_mask": mask}
    assert report.inference.peak_bytes == measure_inference(WritesAConstant, [x], kw_inputs=kw).peak_bytes
    real = measure_training(WritesAConstant, [x], OPTIMIZERS["adam"], "sum", kw_inputs=kw)
    assert report.train.peak_bytes == real.peak_bytes


class CTCHead(nn.Module):
    """A speech recognition head's CTC loss, lengths from the attention mask and the labels
    as transformers' wav2vec2 computes them: the loss's outputs are sized by the longest target."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        log_probs = nn.functional.log_softmax(self.fc(x), -1).transpose(0, 1)
        labels_mask = labels >= 0
        return nn.functional.ctc_loss(log_probs, labels.masked_select(labels_mask), attention_mask.sum(-1),
                                      labels_mask.sum(-1), blank=0, reduction="sum", zero_infinity=True)


def test_ctc_loss_is_sized_by_the_known_target_lengths() -> None:
    specs = ["2x6x8", "attention_mask=2x6:int64", "labels=2x3:int64"]
    report = graphmem.analyze(CTCHead, specs, mode="train", optimizer="sgd")
    assert report.train is not None
    real = measure_training(CTCHead, [torch.randn(2, 6, 8)], OPTIMIZERS["sgd"], "auto",
                            kw_inputs={"attention_mask": torch.ones(2, 6, dtype=torch.int64),
                                       "labels": torch.randint(1, 10, (2, 3))})
    assert report.train.peak_bytes == real.peak_bytes
    assert {p.phase: p.peak_bytes for p in report.train.phases} == real.phase_peaks


class LayerDrop(nn.Module):
    """LayerDrop as transformers writes it: in training a layer is skipped when a uniform
    draw falls below the rate."""

    def __init__(self, rate: float = 0.5) -> None:
        super().__init__()
        self.rate = rate
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < self.rate:
                continue
            x = torch.relu(layer(x))
        return x


def test_a_random_layer_skip_is_recorded_at_its_worst_case_every_time() -> None:
    """Every layer runs in the recording (the draw is taken as its largest value): the same
    answer each run, equal to a real run that skips none, above every real run that skips some."""
    predictions = {graphmem.analyze(LayerDrop, ["8x16"], mode="train", optimizer="adam").train.peak_bytes  # type: ignore[union-attr]
                   for _ in range(3)}
    assert len(predictions) == 1
    report = graphmem.analyze(LayerDrop, ["8x16"], mode="train", optimizer="adam")
    assert report.train is not None
    assert any(note.startswith("upper bound: the model reads a random draw") for note in report.train.assumptions)
    x = torch.randn(8, 16)
    none_skipped = measure_training(lambda: LayerDrop(rate=0.0), [x], OPTIMIZERS["adam"], "auto")
    assert report.train.peak_bytes == none_skipped.peak_bytes
    reals = [measure_training(lambda: LayerDrop(rate), [x], OPTIMIZERS["adam"], "auto").peak_bytes
             for rate in (0.2, 0.4, 0.6)]  # the oracle seeds its runs: the rate varies what is skipped
    assert max(reals) <= report.train.peak_bytes
    assert min(reals) < report.train.peak_bytes  # some real run skipped a layer
