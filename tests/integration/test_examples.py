"""The shipped examples run through the CLI, as a user would run them (small sizes)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from graphmem.cli import main
from tests.conftest import ROOT


@pytest.mark.parametrize("target, args", [
    ("mlp.py:MLP", ["--input", "32x1000"]),
    ("simplenet.py:SimpleNet", ["--input", "8x1x28x28", "--loss", "nll"]),
    ("gpt.py:GPT", ["--input", "2x64:int64", "--loss", "cross_entropy", "--optimizer", "adamw"]),
    ("gpt.py:GPT", ["--input", "2x32:int64", "--kwargs", '{"layers": 1, "dim": 64}', "--dtype", "bfloat16"]),
])
def test_example_runs(target: str, args: list[str]) -> None:
    result = CliRunner().invoke(main, ["analyze", str(ROOT / "examples" / target), *args,
                                       "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["train"]["peak_bytes"] >= data["inference"]["peak_bytes"] > 0
