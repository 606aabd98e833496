"""The commands shown in docs run, and the output shown is what they print (docs cannot drift)."""

from __future__ import annotations

import re
import shlex

import pytest
from click.testing import CliRunner

from graphmem.cli import main
from tests.conftest import ROOT

DOCS = ("docs/parallel.md",)


def _blocks(path: str, kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", (ROOT / path).read_text(), re.S)


def _commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for block in _blocks(path, "bash"):
            found += [(path, line) for line in block.splitlines() if line.startswith("graphmem ")]
    return found


def _shown_outputs() -> list[tuple[str, str, list[str]]]:
    """(doc, command, the output lines shown) for each ```text block that starts with `$ graphmem`."""
    found = []
    for path in DOCS:
        for block in _blocks(path, "text"):
            first, *rest = block.splitlines()
            if first.startswith("$ graphmem "):
                found.append((path, first[2:], [line for line in rest if line.strip() and line != "..."]))
    return found


def _run(command: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, shlex.split(command)[1:])
    return result.exit_code, result.stdout


@pytest.mark.parametrize("doc, command", _commands(), ids=lambda v: v if v.endswith(".md") else v[9:60])
def test_documented_command_runs(doc: str, command: str) -> None:
    code, out = _run(command)
    allowed = (0, 1) if command.split()[1] in ("check", "max-batch", "max-seq") else (0,)
    assert code in allowed, f"{doc}: {command}\n{out}"


@pytest.mark.parametrize("doc, command, lines", _shown_outputs(), ids=lambda v: str(v)[:40])
def test_documented_output_is_what_the_command_prints(doc: str, command: str, lines: list[str]) -> None:
    code, out = _run(command)
    assert code == 0, out
    printed = out.splitlines()
    for line in lines:
        if line.endswith("...)"):  # a title shortened in the docs
            assert any(p.startswith(line[:-4]) for p in printed), f"{doc}: {line!r} not printed"
        else:
            assert line in printed, f"{doc}: {line!r} not printed by {command}"
