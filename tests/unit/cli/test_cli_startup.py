"""The command line starts in a blink: --help, --version and usage errors import no torch, the
group's list of commands is the commands' own, and the choices the CLI offers without torch
are the engine's own."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import click
import pytest
from click.testing import CliRunner

from tests.conftest import ROOT

# Each command's --help and usage errors of every kind click reports (a bad choice, a bad value
# of graphmem's own parsers, an unknown option, a bad path) and that the job's first check
# reports (no input given; two capital letters); all exit 0 (help) or 2.
NO_TORCH = [
    (["analyze", "--help"], 0), (["check", "--help"], 0), (["max-batch", "--help"], 0), (["max-seq", "--help"], 0),
    (["plan", "--help"], 0), (["run", "--help"], 0), (["analyze"], 2), (["check"], 2), (["run"], 2),
    (["analyze", "--mode", "bogus"], 2), (["check", "-i", "3xq"], 2), (["analyze", "-i", "4x4:float99"], 2),
    (["check", "--budget", "12QB"], 2), (["plan", "--margin", "300%"], 2), (["analyze", "--lora", "r=x,target=q"], 2),
    (["analyze", "--timeout", "5parsecs"], 2), (["analyze", "--kwargs", "[1]"], 2), (["analyze", "--nosuch"], 2),
    (["analyze", "--html", "report.txt"], 2), (["analyze", "--output", "/nonexistent/folder/report.txt"], 2),
    (["analyze", "--sweep", "bad"], 2), (["max-batch", "--input", "Bx4", "--input", "Sx4"], 2),
    (["run", "--sdpa", "bogus"], 2), (["analyze", "--format", "json", "--preset", "nope"], 2),
    (["check", "--metric", "bogus"], 2),
]


def test_group_help_lists_each_commands_own_short_help() -> None:
    import graphmem.cli.commands  # noqa: F401  (registers every command)
    from graphmem.cli.group import FIRST_PARAGRAPH, main

    real = {name: " ".join((command.help or "").split("\n\n")[0].split()) for name, command in main.commands.items()}
    assert real == FIRST_PARAGRAPH
    shown = CliRunner().invoke(main, ["--help"])
    assert shown.exit_code == 0 and all(name in shown.output for name in real)


def test_help_and_version_import_no_torch() -> None:
    code = ("import sys\nfrom graphmem.cli.group import main\n"
            "for args in (['--help'], ['--version']):\n"
            "    try:\n        main.main(args, prog_name='graphmem', standalone_mode=False)\n"
            "    except SystemExit:\n        pass\n"
            "print('torch loaded' if 'torch' in sys.modules else 'no torch')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("no torch") and "Commands:" in done.stdout


@pytest.mark.parametrize(("args", "code"), NO_TORCH, ids=[" ".join(args) for args, _ in NO_TORCH])
def test_command_help_and_usage_errors_import_no_torch(args: list[str], code: int) -> None:
    """The whole program (the supervisor and the child that parses), as a user runs it: the
    modules it imported, as ``python -X importtime`` lists them, hold no torch."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "graphmem", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == code, done.stderr[-2000:]
    imported = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "graphmem.cli.options" in imported  # the commands were loaded (importlib's own imports are not listed)
    assert not {name for name in imported if name == "torch" or name.startswith("torch.")}, args
    message = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert (message and message[-1].startswith("Error: ")) if code == 2 else "Usage: graphmem" in done.stdout


def _choices(command: click.Command, name: str) -> list[str]:
    [param] = [p for p in command.params if p.name == name]
    assert isinstance(param.type, click.Choice), name
    return list(param.type.choices)


def test_cli_choices_are_the_engines() -> None:
    """The choices the CLI takes from light modules equal the engine's tables (torch loaded here)."""
    import torch

    import graphmem.cli.commands as commands
    from graphmem.cli.group import main
    from graphmem.job.job import ANALYSIS_MODES, DEVICES, SDPA_CHOICES
    from graphmem.job.optim_formula import FORMULA_OPTIMIZERS
    from graphmem.job.presets import PRESETS
    from graphmem.job.spec import DTYPE_ALIASES, MODEL_DTYPES
    from graphmem.job.step import AMP_DTYPES, LOSSES, OPTIMIZER_CHOICES, OPTIMIZER_IMPLS, OPTIMIZERS
    from graphmem.preflight.search import PREFLIGHT_MODES
    from graphmem.report import RENDERERS, UNIT_CHOICES
    from graphmem.report.dot import COLLAPSE_CHOICES
    from graphmem.report.plan_table import PLAN_RENDERERS
    from graphmem.report.preflight_text import CHECK_RENDERERS, SEARCH_RENDERERS

    engine: dict[str, Any] = {"preset": PRESETS, "amp": AMP_DTYPES, "optimizer_impl": OPTIMIZER_IMPLS,
                              "loss": LOSSES, "dtype": MODEL_DTYPES, "mp_param_dtype": MODEL_DTYPES,
                              "mp_reduce_dtype": MODEL_DTYPES, "device": DEVICES, "sdpa": SDPA_CHOICES,
                              "units": UNIT_CHOICES}
    formats = {"analyze": RENDERERS, "run": RENDERERS, "check": CHECK_RENDERERS, "max-batch": SEARCH_RENDERERS,
               "max-seq": SEARCH_RENDERERS, "plan": PLAN_RENDERERS}
    for name, command in main.commands.items():
        for param, table in [*engine.items(), ("fmt", formats[name]),
                             ("mode", ANALYSIS_MODES if name == "analyze" else PREFLIGHT_MODES)]:
            if any(p.name == param for p in command.params):
                assert _choices(command, param) == list(table), (name, param)
    assert _choices(main.commands["analyze"], "collapse") == list(COLLAPSE_CHOICES)
    assert commands.PREFLIGHT_MODES == PREFLIGHT_MODES
    assert OPTIMIZER_CHOICES == (*OPTIMIZERS, *FORMULA_OPTIMIZERS, "none")
    assert ("adafactor" in OPTIMIZERS) == hasattr(torch.optim, "Adafactor")
    assert {alias: str(dtype) for alias, dtype in DTYPE_ALIASES.items()} == {
        "float32": "torch.float32", "fp32": "torch.float32", "float": "torch.float32", "f32": "torch.float32",
        "float64": "torch.float64", "fp64": "torch.float64", "double": "torch.float64", "f64": "torch.float64",
        "bfloat16": "torch.bfloat16", "bf16": "torch.bfloat16", "float16": "torch.float16", "fp16": "torch.float16",
        "half": "torch.float16", "f16": "torch.float16", "int64": "torch.int64", "long": "torch.int64",
        "i64": "torch.int64", "int32": "torch.int32", "int": "torch.int32", "i32": "torch.int32",
        "int16": "torch.int16", "short": "torch.int16", "int8": "torch.int8", "uint8": "torch.uint8",
        "byte": "torch.uint8", "bool": "torch.bool", "complex64": "torch.complex64", "cfloat": "torch.complex64"}


def test_dtype_sizes_are_torchs() -> None:
    import torch

    from graphmem.job.grammar import DTYPE_BYTES

    assert DTYPE_BYTES == {name: getattr(torch, name).itemsize for name in DTYPE_BYTES}


@pytest.mark.parametrize("args", [["analyze"], ["check", "--format", "json"], ["max-seq"], ["plan"],
                                  ["analyze", "-i", "Bx4", "-i", "Sx4"], ["check", "-i", "4x4", "-i", "7"]])
def test_the_jobs_first_check_before_torch_says_what_make_job_says(args: list[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With every job option but --input at its default, job_from checks the inputs before
    importing the job modules: the same output as make_job's own check, which runs when that
    early check is skipped."""
    import graphmem.cli.commands  # noqa: F401  (registers every command)
    from graphmem.cli import options
    from graphmem.cli.group import main

    early = CliRunner().invoke(main, args)
    monkeypatch.setattr(options, "validate_inputs", lambda *args, **kwargs: None)
    late = CliRunner().invoke(main, args)
    assert early.exit_code == 2 and "Error: " in early.output
    assert (early.exit_code, early.output) == (late.exit_code, late.output)
