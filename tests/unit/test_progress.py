"""Progress lines: on stderr only, never in stdout or JSON; off unless stderr is a terminal or
--progress is given; work shorter than PROGRESS_AFTER_S shows none.  Every line carries the
time since the command started; plan names the row each line is about ("row k/N")."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

import graphmem.cli.process as process
from graphmem.cli import main
from graphmem.process import progress
from tests.conftest import ROOT

MLP = str(ROOT / "examples" / "mlp.py") + ":MLP"
ARGS = ["analyze", MLP, "--input", "4x1000", "--mode", "train", "--format", "json"]


def _run(monkeypatch: pytest.MonkeyPatch, *extra: str, after_s: float = 0.0) -> tuple[str, str, int]:
    monkeypatch.setattr(process, "PROGRESS_AFTER_S", after_s)
    monkeypatch.setattr("graphmem.trace.core.recorder._PROGRESS_EVERY", 16)
    result = CliRunner().invoke(main, [*ARGS, *extra])
    return result.stdout, result.stderr, result.exit_code


def test_progress_goes_to_stderr_and_json_stays_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    out, err, code = _run(monkeypatch, "--progress")
    assert code == 0
    json.loads(out)  # stdout is one JSON document
    lines = [re.sub(r"^graphmem: \[\d+s\] ", "graphmem: ", line) for line in err.splitlines()]  # elapsed time
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


@pytest.mark.parametrize(("seconds", "text"), [(0.4, "0s"), (59.9, "59s"), (72, "1m12s"), (3599, "59m59s"),
                                               (3600 + 5 * 60 + 9, "1h05m")])
def test_elapsed_time_is_written_short(seconds: float, text: str) -> None:
    assert process._StderrProgress.elapsed_text(seconds) == text


def test_labels_name_the_part_of_the_work() -> None:
    lines: list[str] = []
    with progress.shown_on(lines.append):
        with progress.labelled("row 2/5: fused Adam"):
            progress.show("recording the training step")
            with progress.labelled("inner"):
                progress.show("x")
        progress.show("after")
    assert lines == ["row 2/5: fused Adam — recording the training step", "row 2/5: fused Adam — inner — x", "after"]


PLAN = ["plan", MLP, "--input", "32x1000", "--budget", "1MiB"]
ELAPSED = r"graphmem: \[(\d+s|\d+m\d\ds|\d+h\d\dm)\] "


@pytest.mark.parametrize("processes", ["1", "2"])
def test_plan_names_each_row_and_the_time(monkeypatch: pytest.MonkeyPatch, processes: str) -> None:
    monkeypatch.setenv("GRAPHMEM_PROCESSES", processes)
    monkeypatch.setattr(process, "PROGRESS_AFTER_S", 0.0)
    quiet = CliRunner().invoke(main, PLAN)
    shown = CliRunner().invoke(main, [*PLAN, "--progress"])
    assert quiet.exit_code == shown.exit_code == 0, shown.output
    assert shown.stdout == quiet.stdout  # progress never reaches stdout
    assert quiet.stderr == ""
    lines = shown.stderr.splitlines()
    assert lines and all(re.match(ELAPSED, line) for line in lines), shown.stderr
    rows = [re.search(r"row (\d+)/(\d+) \(each change alone\): ", line) for line in lines]
    found = {(int(m[1]), int(m[2])) for m in rows if m}
    n = max(total for _, total in found)
    assert {k for k, _ in found} == set(range(1, n + 1)) and n > 3, shown.stderr  # every row, "k/N", named
    assert any(re.match(ELAPSED + r"the job as given — recording the training step$", line) for line in lines)
    assert any(line.endswith(f"({n} of {n} done)") for line in lines), shown.stderr
