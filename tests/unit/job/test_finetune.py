"""--freeze and --lora: parsing and errors before anything is built, and what they change."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner
from torch import nn

import graphmem
from graphmem.cli import main
from graphmem.errors import UserInputError
from graphmem.job.finetune import LoraSpec, parse_freeze, parse_lora, parse_quantize_base
from graphmem.job.job import edited
from tests.conftest import ROOT

MLP = str(ROOT / "examples" / "mlp.py") + ":MLP"  # layers.0: Linear(1000, 500), layers.2: Linear(500, 100)
try:
    import peft
except ImportError:
    peft = None
needs_peft = pytest.mark.skipif(peft is None, reason="peft is not installed (pip install graphmem[lora])")


@needs_peft
def test_a_lora_text_becomes_peft_settings() -> None:
    spec = parse_lora("r=16, alpha=32, target=q_proj,v_proj, dropout=0.05")
    assert spec == LoraSpec(r=16, targets=("q_proj", "v_proj"), alpha=32, dropout=0.05)
    assert str(spec) == "LoRA r=16 on q_proj, v_proj"
    assert parse_lora("target=fc,r=4") == LoraSpec(r=4, targets=("fc",), alpha=8, dropout=0.0), "peft's alpha"


@needs_peft
@pytest.mark.parametrize("text, fragment", [
    ("r=16,rank=4,target=q", "unknown key 'rank'; expected: r, alpha, target, dropout"),
    ("r=0,target=q", "r=0: expected a positive integer"),
    ("r=1.5,target=q", "r='1.5': expected a positive integer"),
    ("r=8", "needs target="),
    ("target=q", "needs r=N"),
    ("r=8,target=q,dropout=1", "dropout=1.0: expected a number from 0"),
    ("r=8,alpha=-1,target=q", "alpha=-1: expected a positive integer"),
    ("r=8,alpha=0.5,target=q", "alpha='0.5': expected a positive integer"),
    ("r=8,q_proj", "'q_proj' is not KEY=VALUE"),
])
def test_a_bad_lora_text_is_refused_naming_the_value(text: str, fragment: str) -> None:
    with pytest.raises(UserInputError, match="^--lora ") as error:
        parse_lora(text)
    assert fragment in str(error.value)


def test_lora_without_peft_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now fails
    with pytest.raises(UserInputError, match=r"pip install 'graphmem\[lora\]'"):
        graphmem.make_job(MLP, "4x1000", lora="r=4,target=layers.0")
    result = CliRunner().invoke(main, ["analyze", MLP, "--input", "4x1000", "--lora", "r=4,target=layers.0"])
    assert result.exit_code == 2, result.output
    assert "pip install 'graphmem[lora]'" in result.output


def test_freeze_patterns_split_on_commas() -> None:
    assert parse_freeze(["a.*, b.*", "c"]) == ("a.*", "b.*", "c")
    assert parse_freeze("all-but:head.*") == ("all-but:head.*",)
    with pytest.raises(UserInputError, match="all-but:GLOB"):
        parse_freeze("all-but:")


@needs_peft
def test_freeze_and_lora_together_are_refused() -> None:
    with pytest.raises(UserInputError, match="--freeze and --lora together"):
        graphmem.make_job(MLP, "4x1000", freeze="layers.0.*", lora="r=4,target=layers.0")


def test_frozen_layers_have_no_gradients() -> None:
    # only layers.2 trains: 500 x 100 weights + 100 biases = 50,100 float32 gradients
    report = graphmem.analyze(MLP, ["4x1000"], mode="train", optimizer="sgd", freeze=["layers.0"])
    assert report.train is not None and report.trained is not None
    assert report.train.grads_bytes == 50_100 * 4
    assert (report.trained.trainable, report.trained.total) == (50_100, 550_600)
    assert report.trained.how == "frozen: layers.0"
    same = graphmem.analyze(MLP, ["4x1000"], mode="train", optimizer="sgd", freeze=["all-but:layers.2.*"])
    assert same.train is not None and same.train.timeline == report.train.timeline


def test_a_pattern_that_matches_nothing_names_the_parameters() -> None:
    with pytest.raises(UserInputError) as error:
        graphmem.analyze(MLP, ["4x1000"], mode="train", freeze=["layers.0.*", "encoder.*"])
    assert str(error.value).startswith("--freeze 'encoder.*' matches no parameter; names look like: layers.0.weight")


def test_a_models_own_instance_is_left_as_it_is() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    report = graphmem.analyze(model, ["2x8"], mode="train", freeze="0.*")
    assert report.trained is not None and report.trained.trainable == 8 * 2 + 2
    assert all(p.requires_grad and not p.is_meta for p in model.parameters())


@needs_peft
def test_lora_trains_only_its_adapters() -> None:
    # r=4 on layers.0 (1000 -> 500): A is 4 x 1000, B is 500 x 4
    report = graphmem.analyze(MLP, ["4x1000"], mode="train", optimizer="sgd", lora="r=4,target=layers.0")
    assert report.train is not None and report.trained is not None
    assert report.trained.trainable == 4 * 1000 + 500 * 4
    assert report.trained.total == 550_600 + 6_000
    assert report.train.grads_bytes == 6_000 * 4


@needs_peft
def test_a_lora_target_that_matches_nothing_names_the_modules() -> None:
    with pytest.raises(UserInputError, match=r"^--lora target 'q_proj' matches no module; module names end in: "):
        graphmem.analyze(MLP, ["4x1000"], mode="train", lora="r=4,target=q_proj")


def test_updated_takes_freeze_and_lora_texts() -> None:
    job = edited(graphmem.make_job(MLP, "4x1000"), freeze="layers.0.*,layers.2.bias")
    assert job.finetune is not None and job.finetune.freeze == ("layers.0.*", "layers.2.bias")


def test_the_report_says_what_trains() -> None:
    result = CliRunner().invoke(main, ["analyze", MLP, "--input", "4x1000", "--mode", "train",
                                       "--freeze", "layers.0.*", "--freeze", "layers.2.bias"])
    assert result.exit_code == 0, result.output
    assert "trained     50,000 of 550,600 parameters (9.08%); frozen: layers.0.*, layers.2.bias" in result.output
    as_json = CliRunner().invoke(main, ["analyze", MLP, "--input", "4x1000", "--mode", "train",
                                        "--freeze", "layers.0.*,layers.2.bias", "--format", "json"])
    train = json.loads(as_json.stdout)["train"]
    assert (train["trainable_parameters"], train["total_parameters"]) == (50_000, 550_600)


def test_the_command_line_refuses_a_pattern_that_matches_nothing() -> None:
    result = CliRunner().invoke(main, ["analyze", MLP, "--input", "4x1000", "--freeze", "encoder.*"])
    assert result.exit_code == 2, result.output
    assert "Error: --freeze 'encoder.*' matches no parameter" in result.output


@needs_peft
def test_the_command_line_refuses_a_bad_lora_text_as_usage() -> None:
    result = CliRunner().invoke(main, ["analyze", MLP, "--input", "4x1000", "--lora", "r=8,rank=2"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--lora'" in result.output and "unknown key 'rank'" in result.output


def test_training_all_parameters_says_nothing_more() -> None:
    result = CliRunner().invoke(main, ["analyze", MLP, "--input", "4x1000", "--mode", "train"])
    assert result.exit_code == 0, result.output
    assert "trained " not in result.output


def test_a_quantized_base_needs_lora() -> None:
    with pytest.raises(UserInputError, match="--quantize-base needs --lora"):
        graphmem.make_job(MLP, ["4x1000"], quantize_base="nf4")


def test_an_unknown_quantized_base_names_the_kinds() -> None:
    with pytest.raises(UserInputError, match="nf4, nf4-dq, fp4"):
        parse_quantize_base("int3")


def test_a_quantized_base_without_bitsandbytes_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes now raises ImportError
    with pytest.raises(UserInputError, match=r"bitsandbytes package: pip install 'graphmem\[qlora\]'"):
        parse_quantize_base("nf4")


def test_the_command_line_refuses_a_quantized_base_without_lora_in_one_line() -> None:
    result = CliRunner().invoke(main, ["analyze", MLP, "--input", "4x1000", "--quantize-base", "nf4"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "Error: --quantize-base needs --lora: quantized base weights do not train, so QLoRA trains LoRA adapters "
        "on them (e.g. --lora r=16,alpha=32,target=all-linear)"]


@needs_peft
def test_a_model_without_linear_layers_has_nothing_to_quantize() -> None:
    pytest.importorskip("bitsandbytes")

    class Convs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.conv(x)

    with pytest.raises(UserInputError, match="no linear layer to quantize"):
        graphmem.analyze(Convs(), ["1x3x8x8"], mode="train", lora="r=2,target=conv", quantize_base="nf4")


def test_a_quantized_base_is_refused_with_sharding() -> None:
    with pytest.raises(UserInputError, match="only DDP"):
        graphmem.make_job(MLP, ["4x1000"], lora="r=2,target=layers.0", quantize_base="nf4", parallel="fsdp=2")
