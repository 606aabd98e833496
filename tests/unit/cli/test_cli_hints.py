"""The CLI's hints for common first mistakes, and the help texts that list what is accepted."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from graphmem.cli import main
from graphmem.errors import UserInputError
from graphmem.job.parallel import PARALLEL_NAMES, parse_parallel
from tests.conftest import ROOT

SOURCE = """
import torch
from torch import nn

class NeedsArguments(nn.Module):
    def __init__(self, width, depth=2, *, heads):
        super().__init__()
        self.fc = nn.Linear(width, width)
    def forward(self, x):
        return self.fc(x)

def make_net(width):
    return NeedsArguments(width, heads=1)

class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(16, 4)
    def forward(self, ids):
        return self.tok(ids)
"""


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def _flat(text: str) -> str:
    """Help text with click's line wrapping undone."""
    return " ".join(text.split())


# --- a constructor missing required arguments names them as --kwargs ---------------------------

@pytest.mark.parametrize("target, given, fragment", [
    ("NeedsArguments", None, """with --kwargs '{"width": ..., "heads": ...}'"""),  # depth has a default
    ("NeedsArguments", '{"width": 4}',
     """give the missing argument heads with --kwargs '{"width": 4, "heads": ...}'"""),
    ("make_net", None, """give the missing argument width with --kwargs '{"width": ...}'"""),
])
def test_missing_constructor_arguments_are_named(make_module: Callable[[str], str], target: str,
                                                 given: str | None, fragment: str) -> None:
    kwargs = ["--kwargs", given] if given else []
    result = run("analyze", f"{make_module(SOURCE)}:{target}", "-i", "2x4", *kwargs)
    assert result.exit_code == 2, result.output
    assert "could not be built: TypeError" in result.output and fragment in result.output
    assert "check --kwargs" not in result.output  # the hint says what to add instead
    assert "Traceback" not in result.output


def test_all_arguments_given_builds(make_module: Callable[[str], str]) -> None:
    result = run("analyze", f"{make_module(SOURCE)}:NeedsArguments", "-i", "2x4", "--kwargs",
                 '{"width": 4, "heads": 2}', "--format", "json", "--mode", "inference")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["inference"]["params_bytes"] == (4 * 4 + 4) * 4  # Linear(4, 4) with bias


# --- float token ids into an embedding: write the input as integers ----------------------------

@pytest.mark.parametrize("given, fragment", [
    ("8x256", "token ids are integers: write the input as 8x256:int64"),
    ("ids=2x3", "token ids are integers: write the input as ids=2x3:int64"),
])
def test_float_token_ids_get_the_int64_input(make_module: Callable[[str], str], given: str, fragment: str) -> None:
    result = run("analyze", f"{make_module(SOURCE)}:Tokens", "-i", given)
    assert result.exit_code == 2, result.output
    assert result.output.rstrip().endswith(fragment), result.output
    assert "Traceback" not in result.output


def test_the_shipped_gpt_with_float_ids_gets_the_hint() -> None:
    result = run("analyze", str(ROOT / "examples" / "gpt.py") + ":GPT", "--input", "8x256")
    assert result.exit_code == 2, result.output
    assert "write the input as 8x256:int64" in result.output


def test_integer_token_ids_need_no_hint(make_module: Callable[[str], str]) -> None:
    result = run("analyze", f"{make_module(SOURCE)}:Tokens", "-i", "2x3:int64", "--mode", "inference")
    assert result.exit_code == 0, result.output


# --- --hf-config: the model is named by the class its config names -----------------------------

def test_a_config_file_names_the_model_by_its_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install graphmem[hf])")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64}))
    monkeypatch.chdir(tmp_path)
    args = ["analyze", "--hf-config", "conf/config.json", "--input", "input_ids=1x4:int64", "--mode", "inference"]
    table = run(*args)
    assert table.exit_code == 0, table.output
    assert "model       LlamaForCausalLM (from conf/config.json)\n" in table.output
    report = run(*args, "--format", "json")
    assert json.loads(report.output)["target"] == "LlamaForCausalLM (from conf/config.json)"


# --- help texts list what is accepted ----------------------------------------------------------

def test_parallel_help_shows_every_strategy_the_parser_accepts() -> None:
    result = run("analyze", "--help")
    assert result.exit_code == 0, result.output
    text = _flat(result.output)
    help_text = text[text.index("--parallel NAME=N"):text.index("--parallelize")]
    shown = re.findall(r"\b[a-z0-9]+=\d+(?:,[a-z0-9]+=\d+)*", help_text)
    combinations = {frozenset(name for name, _ in parse_parallel(example).degrees) for example in shown}
    # every one and every pair of strategies that --parallel accepts is shown
    accepted = set()
    for size in (1, 2):
        for names in itertools.combinations(PARALLEL_NAMES, size):
            try:
                parse_parallel(",".join(f"{name}=2" for name in names))
            except UserInputError:
                continue
            accepted.add(frozenset(names))
    assert {"ddp", "fsdp", "zero1", "tp", "pp"} <= {name for names in accepted for name in names}
    assert combinations == accepted


def test_group_help_lists_every_exit_code_of_the_docs() -> None:
    result = run("--help")
    assert result.exit_code == 0, result.output
    text = _flat(result.output)
    documented = set(re.findall(r"^\| (\d+) \|", (ROOT / "docs" / "exit-codes.md").read_text(), re.M))
    assert documented >= {"0", "1", "2", "3", "129", "130", "141", "143"}
    for code in documented:
        assert re.search(rf"\b{code}\b", text), code
    assert "1 does not fit (check, max-batch, max-seq)" in text
    assert "--timeout passed" in text
    for signal in ("SIGHUP", "SIGINT", "SIGTERM"):
        assert signal in text
