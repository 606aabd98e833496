"""Progress lines: on stderr only, never in stdout or JSON; off unless stderr is a terminal or
--progress is given; work shorter than PROGRESS_AFTER_S shows none."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import graphmem.cli.process as process
from graphmem import progress
from graphmem.cli import main
from tests.conftest import ROOT

MLP = str(ROOT / "examples" / "mlp.py") + ":MLP"
ARGS = ["analyze", MLP, "--input", "4x1000", "--mode", "train", "--format", "json"]


def _run(monkeypatch: pytest.MonkeyPatch, *extra: str, after_s: float = 0.0) -> tuple[str, str, int]:
    monkeypatch.setattr(process, "PROGRESS_AFTER_S", after_s)
    monkeypatch.setattr("graphmem.trace.recorder._PROGRESS_EVERY", 16)
    result = CliRunner().invoke(main, [*ARGS, *extra])
    return result.stdout, result.stderr, result.exit_code


def test_progress_goes_to_stderr_and_json_stays_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    out, err, code = _run(monkeypatch, "--progress")
    assert code == 0
    json.loads(out)  # stdout is one JSON document
    lines = err.splitlines()
    assert "graphmem: recording the training step" in lines
    assert any(line.startswith("graphmem: recording: iteration 2, ") for line in lines), err
    assert any(line.startswith("graphmem: analysing ") for line in lines), err
    assert "graphmem:" not in out


@pytest.mark.parametrize("extra", [(), ("--no-progress",)])
def test_off_when_stderr_is_not_a_terminal_or_turned_off(monkeypatch: pytest.MonkeyPatch,
                                                         extra: tuple[str, ...]) -> None:
    out, err, code = _run(monkeypatch, *extra)
    assert code == 0 and "graphmem:" not in err


def test_short_work_shows_none(monkeypatch: pytest.MonkeyPatch) -> None:
    out, err, code = _run(monkeypatch, "--progress", after_s=3600)
    assert code == 0 and "graphmem:" not in err


def test_the_library_shows_nothing_without_a_sink(capsys: pytest.CaptureFixture[str]) -> None:
    assert not progress.active()
    progress.show("nobody listens")
    assert capsys.readouterr() == ("", "")
