"""The commands shown in docs run, and the output shown is what they print (docs cannot drift)."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from graphmem.cli import main
from tests.conftest import ROOT

DOCS = ("README.md", "docs/parallel.md", "docs/preflight.md", "docs/transformers.md", "docs/finetuning.md",
        "docs/run.md", "docs/visualisation.md", "docs/values.md")
# placeholders a reader fills in, not runnable as written
_TEMPLATES = ("$", "path/to/", "train.py:")
# options naming a file the command writes: written to the test's temporary folder, not the checkout
_FILE_OPTIONS = ("--html", "--output", "--timeline", "--dot", "--snapshot", "--emit-policy", "--policy-curve")
# the preset commands over 10 s here: an 8B model's base quantized, a sweep of seven lengths, a 70B model generating
_SLOW = ("--quantize-base", "--sweep ", "--preset llama-3-70b")


# a worked case of docs/preflight.md: minutes on 2 cores (plan --policy of an 8B preset under FSDP2)
_WORKED = pytest.mark.skipif(os.environ.get("GRAPHMEM_WORKED_CASES") != "1",
                             reason="a worked case: minutes on 2 cores; set GRAPHMEM_WORKED_CASES=1")


def _slow(command: str) -> bool:
    return ("--preset " in command and any(s in command for s in _SLOW)) or _worked(command) \
        or ("--parallel " in command and "-policy" in command)


def _worked(command: str) -> bool:
    return "--preset " in command and ("--policy" in command or "--emit-policy" in command)


def _marked(cases: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Each (doc, command, ...) as a parameter, marked slow where ``_slow`` says so (and skipped
    without GRAPHMEM_WORKED_CASES=1 where ``_worked`` does)."""
    return [pytest.param(*case, marks=[*([pytest.mark.slow] if _slow(case[1]) else []),
                                       *([_WORKED] if _worked(case[1]) else [])]) for case in cases]


def _blocks(path: str, kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", (ROOT / path).read_text(), re.S)


def _commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for block in _blocks(path, "bash"):
            found += [(path, line.split(" | ")[0].split("  #")[0]) for line in block.splitlines()
                      if line.startswith("graphmem ") and not line.endswith("\\")
                      and not any(t in line for t in _TEMPLATES)]
    return found


def _shown_outputs() -> list[tuple[str, str, list[str]]]:
    """(doc, command, the output lines shown) for each `$ graphmem ...` in a ```text block; a
    following `$ echo $?` adds the line "exit N"."""
    found: list[tuple[str, str, list[str]]] = []
    for path in DOCS:
        for block in _blocks(path, "text"):
            if not block.startswith("$ graphmem "):
                continue
            for line in block.splitlines():
                if line.startswith("$ graphmem "):
                    found.append((path, line[2:], []))
                elif line.startswith("$ echo $?"):
                    found[-1][2].append("exit")
                elif found[-1][2][-1:] == ["exit"]:
                    found[-1][2][-1] = f"exit {line.strip()}"
                elif line.strip() and line != "...":
                    found[-1][2].append(line)
    return found


def _run(command: str, folder: Path) -> tuple[int, str]:
    if "--lora" in command:
        pytest.importorskip("peft", reason="peft is not installed (pip install graphmem[lora])")
    args = shlex.split(command)[1:]
    args = [str(folder / Path(arg).name) if option in _FILE_OPTIONS else arg for option, arg in zip(["", *args], args)]
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.stdout


def _expected_exit(lines: list[str]) -> int:
    return next((int(line.split()[1]) for line in lines if line.startswith("exit ")), 0)


def _commands_without_output() -> list[tuple[str, str]]:
    """The commands whose output no doc shows (the others run, exit code and all, in
    test_documented_output_is_what_the_command_prints)."""
    shown = {command for _, command, _ in _shown_outputs()}
    return [(doc, command) for doc, command in _commands() if command not in shown]


@pytest.mark.parametrize("doc, command", _marked(_commands_without_output()),
                         ids=lambda v: v if v.endswith(".md") else v[9:60])
def test_documented_command_runs(doc: str, command: str, tmp_path: Path) -> None:
    code, out = _run(command, tmp_path)
    allowed = (0, 1) if command.split()[1] in ("check", "max-batch", "max-seq") else (0,)
    assert code in allowed, f"{doc}: {command}\n{out}"


@pytest.mark.parametrize("doc, command, lines", _marked(_shown_outputs()), ids=lambda v: str(v)[:40])
def test_documented_output_is_what_the_command_prints(doc: str, command: str, lines: list[str],
                                                      tmp_path: Path) -> None:
    code, out = _run(command, tmp_path)
    assert code == _expected_exit(lines), out
    printed = out.splitlines()
    for line in (line for line in lines if not line.startswith("exit ")):
        if line.endswith("...)"):  # a title shortened in the docs
            assert any(p.startswith(line[:-4]) for p in printed), f"{doc}: {line!r} not printed"
        else:
            assert line in printed, f"{doc}: {line!r} not printed by {command}"
