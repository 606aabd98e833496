from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from click.testing import CliRunner

from graphmem import __version__
from graphmem.cli import main
from tests.conftest import ROOT

MLP = str(ROOT / "examples" / "mlp.py") + ":MLP"

USER_SOURCE = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.fc = nn.Linear(4, hidden)
    def forward(self, x):
        return self.fc(x)

class ReadsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x

class Nonzero(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
    def forward(self, x):
        return self.fc(x)[x.nonzero()[:, 0]]
"""


def run(*args: str) -> object:
    return CliRunner().invoke(main, list(args))


def test_version() -> None:
    result = run("--version")
    assert result.exit_code == 0 and __version__ in result.output


def test_table_output() -> None:
    result = run("analyze", MLP, "--input", "4x1000")
    assert result.exit_code == 0, result.output
    for fragment in ("train / inference", "Live at the peak, by category", "Where the peak happens",
                     "Training peak by phase", "optimizer_state"):
        assert fragment in result.output


def test_json_output_schema() -> None:
    result = run("analyze", MLP, "--input", "4x1000", "--format", "json", "--optimizer", "sgd")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert {"graphmem_version", "target", "device", "inputs", "inference", "train"} <= set(data)
    train = data["train"]
    for key in ("optimizer", "peak_bytes", "params_bytes", "buffers_bytes", "grads_bytes",
                "optimizer_state_bytes", "activations_bytes", "phases", "peak", "breakdown"):
        assert key in train
    assert {"forward", "backward", "optimizer"} <= set(train["phases"])
    assert {"op", "module", "phase"} <= set(train["peak"])
    assert train["optimizer"] == "sgd"
    assert sum(train["breakdown"].values()) == train["peak_bytes"]


def test_mode_not_asked_for_is_absent() -> None:
    result = run("analyze", MLP, "--input", "4x1000", "--format", "json", "--mode", "inference")
    data = json.loads(result.output)
    assert "inference" in data and "train" not in data


def test_kwargs_reach_the_constructor(make_module: Callable[[str], str]) -> None:
    name = make_module(USER_SOURCE)
    small = json.loads(run("analyze", f"{name}:Net", "-i", "2x4", "--format", "json").output)
    big = json.loads(run("analyze", f"{name}:Net", "-i", "2x4", "--kwargs", '{"hidden": 64}',
                         "--format", "json").output)
    # Linear(4, h) with bias: (4h + h) * 4 bytes
    assert small["inference"]["params_bytes"] == (4 * 8 + 8) * 4
    assert big["inference"]["params_bytes"] == (4 * 64 + 64) * 4


def test_units_and_output_file(tmp_path: object) -> None:
    out = f"{tmp_path}/report.txt"
    result = run("analyze", MLP, "--input", "4x1000", "--units", "KiB", "-o", out)
    assert result.exit_code == 0 and result.output == ""
    assert "KiB" in open(out).read()


@pytest.mark.parametrize("args, code, fragment", [
    (["analyze", "nosuchmodule_xyz:Net", "-i", "2x4"], 2, "cannot import module 'nosuchmodule_xyz'"),
    (["analyze", "{mod}:Missing", "-i", "2x4"], 2, "has no attribute 'Missing'"),
    (["analyze", "{mod}:Net", "-i", "2xq"], 2, "dimension 'q'"),
    (["analyze", "{mod}:Net", "-i", "2x4:float9"], 2, "unknown dtype 'float9'"),
    (["analyze", "{mod}:Net", "-i", "2x4", "--kwargs", "{oops"], 2, "not valid JSON"),
    (["analyze", "{mod}:Net", "-i", "2x4", "--kwargs", '{"nope": 1}'], 2, "unexpected keyword"),
    (["analyze", "{mod}:Net", "-i", "2x5"], 2, "check that --input shapes"),
    (["analyze", "{mod}:ReadsValues", "-i", "2x4"], 3, "reads a tensor's value"),
    (["analyze", "{mod}:Net"], 2, "no input given"),
])
def test_errors_are_one_line_with_exit_code(make_module: Callable[[str], str], args: list[str],
                                           code: int, fragment: str) -> None:
    name = make_module(USER_SOURCE)
    result = run(*[a.replace("{mod}", name) for a in args])
    assert result.exit_code == code, result.output
    assert fragment in result.output
    assert "Traceback" not in result.output


def test_debug_shows_the_traceback(make_module: Callable[[str], str]) -> None:
    name = make_module(USER_SOURCE)
    result = run("analyze", f"{name}:ReadsValues", "-i", "2x4", "--debug")
    assert result.exit_code != 0
    assert result.exception is not None and "reads a tensor's value" in str(result.exception)


def test_value_dependent_sizes_give_an_upper_bound(make_module: Callable[[str], str]) -> None:
    name = make_module(USER_SOURCE)
    result = run("analyze", f"{name}:Nonzero", "-i", "2x4")
    assert result.exit_code == 0, result.output
    assert "upper bound: nonzero depends on values" in result.output
    half = run("analyze", f"{name}:Nonzero", "-i", "2x4", "--assume", "nonzero=0.5", "--format", "json")
    assert half.exit_code == 0, half.output
    assert any("--assume nonzero=0.5" in a for a in json.loads(half.stdout)["train"]["assumptions"])


def test_analyze_shows_every_setting_that_changes_the_numbers() -> None:
    """--amp, --checkpoint, --grad-accum and the optimizer appear in analyze's header and its JSON."""
    gpt = str(ROOT / "examples" / "gpt.py") + ":GPT"
    args = ["analyze", gpt, "--input", "2x64:int64", "--loss", "cross_entropy", "--mode", "train",
            "--optimizer", "adamw", "--amp", "bf16", "--checkpoint", "Block", "--grad-accum", "2"]
    text = CliRunner().invoke(main, args)
    assert text.exit_code == 0, text.output
    header = text.output.split("\n\n")[0].splitlines()
    for label, value in (("optimizer", "adamw"), ("autocast", "bf16"), ("checkpointing", "every Block"),
                         ("accumulation", "2 micro-batches")):
        assert any(line.startswith(label) and value in line for line in header), (label, header)
    data = json.loads(CliRunner().invoke(main, [*args, "--format", "json"]).output)
    setup = data["setup"]
    assert setup["optimizer"] == "adamw" and setup["amp"] == "bf16" and setup["grad_accum"] == 2
    assert setup["checkpoint"]["classes"] == ["Block"]
