"""One Job: built from keywords or the command line, validated when built, taken whole."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

import graphmem
from graphmem.cli import main
from graphmem.cli.options import JOB_OPTION_NAMES
from graphmem.errors import UserInputError
from graphmem.job import Job, StepConfig, make_job
from graphmem.job.job import edited
from graphmem.job.sections import ModelSpec
from graphmem.job.step_config import ChosenBlocks, EveryBlock, Selective
from tests.conftest import ROOT

MLP = str(ROOT / "examples" / "mlp.py") + ":MLP"
COMMANDS = ("analyze", "check", "max-batch", "max-seq", "plan")


def test_keywords_build_the_job_the_fields_say() -> None:
    job = make_job(MLP, ["32x1000", graphmem.InputSpec((4,), torch.int64, "ids")], mode="train",
                   optimizer="sgd", amp="bf16", checkpoint="Block, Layer", grad_accum=2, dtype="bf16",
                   kwargs={"hidden": 3}, generate="8+4", batch=2, gpu="a100-80gb")
    assert job.inputs.specs == ("32x1000", "ids=4:int64")
    assert job.step == StepConfig(optimizer="sgd", amp="bf16", checkpoint=EveryBlock(("Block", "Layer")), grad_accum=2)
    assert job.model.dtype is torch.bfloat16 and job.model.kwargs == {"hidden": 3}
    assert (job.generate.prompt, job.generate.new, job.generate.batch) == (8, 4, 2)  # type: ignore[union-attr]
    assert job.device == "cuda", "a GPU alone means the CUDA target"
    assert make_job(MLP, "1x1000").device == "cpu"


def test_a_job_is_frozen_and_checked_whenever_it_is_built() -> None:
    job = make_job(MLP, "32x1000")
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.mode = "train"  # type: ignore[misc]
    for bad in ({"mode": "everything"}, {"device": "tpu"}, {"sdpa": "fast"}, {"inputs": ("32xa",)},
                {"loss": "hinge"}, {"preset": "no-such-model"}, {"device": "cuda", "gpu": "no-such-gpu"},
                {"device": "cuda", "alloc_conf": "bogus:1"}, {"checkpoint_every": 2}):
        with pytest.raises(UserInputError):
            edited(job, **bad)
    with pytest.raises(UserInputError):
        dataclasses.replace(job, step=StepConfig(loss="hinge"))
    with pytest.raises(UserInputError, match="no input"):
        Job(model=ModelSpec(MLP))


def test_edited_takes_the_keywords() -> None:
    job = make_job(MLP, "32x1000", mode="train")
    changed = edited(job, optimizer="sgd", checkpoint=["A"], kwargs={"x": 1}, inputs=["8x1000"], dtype="float16")
    assert changed.step.optimizer == "sgd" and changed.step.checkpoint == EveryBlock(("A",))
    assert changed.model.kwargs == {"x": 1} and changed.inputs.specs == ("8x1000",)
    assert changed.model.dtype is torch.float16
    assert edited(changed) == changed, "a job's keywords give the job back"
    with pytest.raises(TypeError, match="nosuch"):
        edited(job, nosuch=1)
    assert job.step.optimizer == "adam", "the original job is unchanged"


def test_checkpointing_is_one_of_three_variants() -> None:
    def chosen(**given: object) -> object:
        return make_job(MLP, "32x1000", checkpoint="Block", **given).step.checkpoint

    assert chosen() == EveryBlock(("Block",))
    assert chosen(checkpoint_every=2, checkpoint_save="matmuls") == Selective(("Block",), 2, ("matmuls",))
    assert chosen(checkpoint_blocks="0-1", checkpoint_save_in="1=matmuls") == ChosenBlocks(
        ("Block",), (0, 1), save_in=((1, ("matmuls",)),))
    with pytest.raises(UserInputError, match="--checkpoint-blocks names the blocks"):
        chosen(checkpoint_blocks="0", checkpoint_every=2)


def test_analyze_takes_a_job_or_the_same_keywords() -> None:
    job = make_job(MLP, "4x1000", optimizer="sgd")
    by_job, by_keywords = graphmem.analyze(job), graphmem.analyze(MLP, ["4x1000"], optimizer="sgd")
    assert by_job.train is not None and by_keywords.train is not None
    assert by_job.train.timeline == by_keywords.train.timeline
    assert by_job.inference is not None and by_keywords.inference is not None
    assert by_job.inference.peak_bytes == by_keywords.inference.peak_bytes


def test_analyze_refuses_a_symbolic_input_and_names_the_search() -> None:
    with pytest.raises(UserInputError, match="max-batch"):
        graphmem.analyze(MLP, ["Bx1000"])


def _option_names(command: str) -> set[str]:
    return {str(p.name) for p in main.commands[command].params}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_every_job_option(command: str) -> None:
    assert set(JOB_OPTION_NAMES) <= _option_names(command)


def test_pre_flight_takes_the_same_model_as_analyze(tmp_path: object) -> None:
    """A transformers model from a config: check compares the peak analyze reports."""
    config = json.dumps({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32,
                         "bos_token_id": 0, "eos_token_id": 0})
    args = ["transformers:GPT2LMHeadModel", "--hf-config-kwargs", config, "--input", "input_ids=2x16:int64",
            "--mode", "train", "--format", "json"]
    analysed = CliRunner().invoke(main, ["analyze", *args])
    assert analysed.exit_code == 0, analysed.output
    peak = json.loads(analysed.stdout)["train"]["peak_bytes"]
    checked = CliRunner().invoke(main, ["check", *args, "--budget", f"{peak}B"])
    assert checked.exit_code == 0, checked.output
    assert json.loads(checked.stdout)["peak_bytes"] == peak
    too_small = CliRunner().invoke(main, ["check", *args, "--budget", f"{peak - 1}B"])
    assert too_small.exit_code == 1, too_small.output
