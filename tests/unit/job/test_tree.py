"""The job's configuration tree: each setting one field, from which the command line, the Python
keywords, the report's header and its JSON ``setup`` are derived (graphmem.job.option)."""

from __future__ import annotations

import ast
import dataclasses
import re
from collections import defaultdict
from types import MappingProxyType
from typing import Any

import click
import pytest
from click.testing import CliRunner

import graphmem.cli.commands  # noqa: F401  (registers every command)
from graphmem.cli.group import main
from graphmem.cli.options import GraphmemCommand, job_options, output_options
from graphmem.job.job import Job, keyword_values, make_job
from graphmem.job.option import declared, option, section, shown
from graphmem.job.sections import Target
from graphmem.job.step_config import ChosenBlocks, StepConfig
from graphmem.report.header import render_header, settings_of, settings_to_dict
from tests.conftest import ROOT

MLP = str(ROOT / "examples" / "mlp.py") + ":MLP"


def _flags(section_type: type) -> list[str]:
    return [flag.split("/")[0] for found in declared(section_type) if found.option is not None
            for flag in found.option.flags if flag.startswith("-")]


def _help(*args: str) -> str:
    result = CliRunner().invoke(main, [*args, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("command", ["analyze", "check", "max-batch", "max-seq", "plan"])
def test_every_command_help_lists_what_the_tree_declares(command: str) -> None:
    shown_flags = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", _help(command)))
    assert set(_flags(Job)) <= shown_flags
    assert len(_flags(Job)) >= 40  # the whole tree, not one section


def test_run_help_lists_the_target_section() -> None:
    """graphmem run takes the same target options as analyze, declared once."""
    shown_flags = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", _help("run")))
    assert set(_flags(Target)) == {"--device", "--gpu", "--sdpa", "--alloc-conf"} <= shown_flags


def test_each_setting_is_one_keyword_and_one_option() -> None:
    keywords = [found.option.keyword for found in declared(Job) if found.option is not None]
    assert len(keywords) == len(set(keywords))
    flags = _flags(Job)
    assert len(flags) == len(set(flags))


def test_a_job_gives_its_keywords_back() -> None:
    job = make_job(MLP, "8x1000", mode="train", optimizer="sgd", checkpoint="Block", checkpoint_blocks="0-1",
                   checkpoint_save="matmuls", checkpoint_save_blocks="1", gpu="a100-40gb", parallel="fsdp=2",
                   fsdp_keep_units="0", freeze=["layers.0.*"], assume={"x": "ones"})
    assert make_job(**keyword_values(job)) == job
    assert isinstance(job.step.checkpoint, ChosenBlocks)


@dataclasses.dataclass(frozen=True, slots=True)
class _Seeded(StepConfig):
    """The step with one more setting, as a contributor would add it."""

    seed: int = dataclasses.field(default=0, metadata=option(
        "--seed", kind="int", minimum=0, default=0, help="The random seed of the step.")
        | shown(key="seed", label="seed", row=lambda value, facts: f"{value} (torch.manual_seed)" if value else ""))


def test_a_new_field_reaches_help_header_and_json_with_no_other_edit(monkeypatch: pytest.MonkeyPatch) -> None:
    step = Job.__dataclass_fields__["step"]
    monkeypatch.setattr(step, "metadata", MappingProxyType({**step.metadata, **section(_Seeded)}))

    @click.command(cls=GraphmemCommand)
    @job_options(("both", "train", "inference"), "both")
    @output_options(["table", "json"])
    def command(**options: Any) -> None:
        """A command built as graphmem's are."""

    assert "--seed INTEGER RANGE" in CliRunner().invoke(command, ["--help"], terminal_width=200).output
    job = make_job(MLP, "8x1000", seed=7, optimizer="sgd")
    assert isinstance(job.step, _Seeded) and job.step.seed == 7 and job.step.optimizer == "sgd"
    header = render_header("graphmem analyze", job.target_name, job.inputs.specs, job.device, setup=settings_of(job))
    assert re.search(r"^seed +7 \(torch.manual_seed\)$", header, re.M), header
    assert settings_to_dict(settings_of(job))["seed"] == 7


def test_checkpoint_variants_share_their_options() -> None:
    """--checkpoint and --checkpoint-save are fields of several variants, declared once."""
    names = [found.option.name for found in declared(StepConfig) if found.option is not None]
    assert names.count("--checkpoint") == 1 and names.count("--checkpoint-save") == 1


def _string_literals(path: Any) -> list[str]:
    """The string constants of a module, docstrings left out (they describe, they do not spell)."""
    tree = ast.parse(path.read_text())
    described = {id(node.value) for node in ast.walk(tree)
                 if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in described]


def test_an_option_is_spelled_in_one_module() -> None:
    """A message, hint or "Run it" command naming an option takes its spelling from the tree
    (graphmem.job.option.flag), so renaming an option is one edit."""
    flags = set(_flags(Job)) - {"-i"}
    spelled: dict[str, set[str]] = defaultdict(set)
    for path in sorted((ROOT / "graphmem").rglob("*.py")):
        for text in _string_literals(path):
            for flag in flags:
                if re.search(rf"{re.escape(flag)}(?![\w-])", text):
                    spelled[flag].add(str(path.relative_to(ROOT)))
    several = {flag: sorted(modules) for flag, modules in spelled.items() if len(modules) > 1}
    assert not several
