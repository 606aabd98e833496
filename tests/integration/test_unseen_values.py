"""A size that depends on input values nobody gave is never taken from values graphmem
invented: it is recorded at its bound, and the headline says so; ``--sample`` gives the real
values, and then the real run's bytes (tests/oracles.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import graphmem
from graphmem.cli import main
from tests.oracles import measure_inference, measure_training

MODEL = """
import torch
from torch import nn


class Picks(nn.Module):
    '''The rows whose index is set, through a linear layer: a size the index's values decide.'''

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 1024)

    def forward(self, x, idx):
        return self.lin(x.index_select(0, (idx != 0).nonzero().squeeze(1)))


def batch():
    return [torch.randn(512, 64), torch.randint(0, 4, (512,))]
"""


class Picks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 1024)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(x.index_select(0, (idx != 0).nonzero().squeeze(1)))  # the rows whose index is set


def _real(idx: torch.Tensor) -> tuple[int, int]:
    inputs = [torch.randn(512, 64), idx]
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)
    return measure_inference(Picks, inputs).peak_bytes, measure_training(Picks, inputs, sgd, "sum").peak_bytes


def test_a_size_from_an_index_nobody_gave_is_its_bound() -> None:
    """idx is filled with zeros by default: (idx != 0).nonzero() would pick no row.  Recorded at its bound
    (every row kept): equal to the real run where every index is set, above any other."""
    report = graphmem.analyze(Picks, ["512x64", "512:int64"], optimizer="sgd", loss="sum")
    assert report.inference is not None and report.train is not None
    predicted = (report.inference.peak_bytes, report.train.peak_bytes)
    assert predicted == _real(torch.ones(512, dtype=torch.int64))  # the bound: every row picked
    for seed in range(3):
        real = _real(torch.randint(0, 4, (512,), generator=torch.Generator().manual_seed(seed)))
        assert predicted[0] >= real[0] and predicted[1] >= real[1]
    assert report.train.trace.unseen_inputs == ("input_1",)


def test_the_sample_gives_the_real_values(tmp_path: Path) -> None:
    idx = torch.randint(0, 4, (512,), generator=torch.Generator().manual_seed(7))
    x = torch.randn(512, 64)
    torch.save({"x": x, "idx": idx}, tmp_path / "batch.pt")  # named: keyword inputs
    report = graphmem.analyze(Picks, sample=str(tmp_path / "batch.pt"), optimizer="sgd", loss="sum")
    assert report.inference is not None and report.train is not None
    assert (report.inference.peak_bytes, report.train.peak_bytes) == _real(idx)
    assert report.train.trace.unseen_inputs == ()
    positional = graphmem.analyze(Picks, sample=[x, idx], optimizer="sgd", loss="sum")  # tensors, from Python
    assert positional.train is not None and positional.train.peak_bytes == report.train.peak_bytes


def test_declared_random_indices_are_facts() -> None:
    """--assume idx=below:4: integers from 0 to 3 drawn with seed 0, as declared: sized by them,
    equal to the real run on the same draw, and not an upper bound."""
    report = graphmem.analyze(Picks, ["512x64", "512:int64"], optimizer="sgd", loss="sum",
                              assume={"input_1": "below:4"})
    assert report.inference is not None and report.train is not None
    drawn = torch.randint(0, 4, (512,), generator=torch.Generator().manual_seed(0))
    assert (report.inference.peak_bytes, report.train.peak_bytes) == _real(drawn)
    assert report.train.trace.unseen_inputs == ()


def test_the_command_line_says_it_in_the_headline(make_module: Callable[[str], str], tmp_path: Path) -> None:
    name = make_module(MODEL)
    runner = CliRunner()
    unseen = runner.invoke(main, ["analyze", f"{name}:Picks", "-i", "512x64", "-i", "512:int64"])
    assert unseen.exit_code == 0, unseen.output
    headline = unseen.output.split("Live at the peak")[0]
    assert "upper bound: sizes depend on values of input_1 that graphmem did not see" in headline
    checked = runner.invoke(main, ["check", f"{name}:Picks", "-i", "512x64", "-i", "512:int64", "--budget", "1GiB"])
    assert checked.exit_code == 0 and "upper bound: sizes depend on values of input_1" in checked.output
    given = runner.invoke(main, ["analyze", f"{name}:Picks", "--sample", f"{name}:batch", "--format", "json"])
    assert given.exit_code == 0, given.output
    document = json.loads(given.output)
    assert document["train"]["unseen_inputs"] == [] and document["inputs"] == ["512x64:float32", "512:int64"]
    as_json = runner.invoke(main, ["analyze", f"{name}:Picks", "-i", "512x64", "-i", "512:int64", "--format", "json"])
    assert json.loads(as_json.output)["train"]["unseen_inputs"] == ["input_1"]


@pytest.mark.parametrize("argv, message", [
    (["--sample", "missing.pt"], "--sample missing.pt: no such file"),
    (["--sample", "batch.pt", "-i", "512x64"], "--sample and --input both given"),
    (["--sample", "words.pt"], "words.pt: torch.load could not read it"),
])
def test_sample_mistakes_are_usage_errors(argv: list[str], message: str, make_module: Callable[[str], str],
                                          tmp_path: Path) -> None:
    name = make_module(MODEL)
    torch.save([torch.randn(512, 64), torch.zeros(512, dtype=torch.int64)], tmp_path / "batch.pt")
    (tmp_path / "words.pt").write_text("not a tensor file")
    result = CliRunner().invoke(main, ["analyze", f"{name}:Picks", *argv])
    assert result.exit_code == 2, result.output
    assert message in result.output
