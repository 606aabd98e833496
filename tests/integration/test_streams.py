"""Closed, full or failing standard streams never change a verdict (docs/exit-codes.md).

Each command runs as a shell runs it, the installed ``graphmem`` with its streams as the case
asks (``2>&-``, ``>&-``, ``> /dev/full``, a pipe nobody reads), in a temporary folder of its own
(TMPDIR) that must be empty after it.  The check used fits (exit 0) and a usage error is exit 2:
a closed stderr keeps both; a closed stdout is 141 where there was a result to write, a failing
one 3 with one ``Error:`` line, never 1; an error's own code stands either way.  A signal ends
graphmem within 2 s even while it is blocked writing the result, and one that comes once the
whole result is there (its output file in place) leaves the result's exit code standing.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.conftest import ROOT

GRAPHMEM = str(Path(sys.executable).with_name("graphmem"))  # the installed command
FITS = ["check", "examples/mlp.py:MLP", "--input", "32x1000", "--budget", "1GiB"]
DOES_NOT_FIT = ["check", "examples/mlp.py:MLP", "--input", "32x1000", "--budget", "1MiB"]
USAGE = [*FITS, "--no-such-option"]


class Run(NamedTuple):
    code: int
    out: str
    err: str
    temp: list[str]  # what it left in its temporary folder


def _shell(args: Sequence[str], redirect: str) -> Run:
    """``graphmem ARGS REDIRECT`` as bash runs it (``exec``: the exit code is graphmem's own)."""
    temp = tempfile.mkdtemp(prefix="graphmem-test-")
    done = subprocess.run(["bash", "-c", f"exec {shlex.join([GRAPHMEM, *args])} {redirect}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180, env={**os.environ, "TMPDIR": temp})
    left = os.listdir(temp)
    if not left:
        os.rmdir(temp)
    return Run(done.returncode, done.stdout, done.stderr, left)


CASES = {
    "stderr_closed_fits": (FITS, "2>&-"),
    "stderr_closed_fits_json": ([*FITS, "--format", "json"], "2>&-"),
    "stderr_closed_usage": (USAGE, "2>&-"),
    "stderr_closed_usage_json": ([*USAGE, "--format", "json"], "2>&-"),
    "stdout_closed_fits": (FITS, ">&-"),
    "stdout_closed_usage": (USAGE, ">&-"),
    "stdout_closed_output_file": ([*FITS, "--output", "{folder}/verdict.txt"], ">&-"),
    "stdout_full_fits": (FITS, "> /dev/full"),
    "stdout_full_does_not_fit": (DOES_NOT_FIT, "> /dev/full"),
    "stdout_full_usage": (USAGE, "> /dev/full"),
}


# every test that takes it is marked slow: the first pays for all its commands (~25 s here)
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    folder = tmp_path_factory.mktemp("streams")
    calls = {name: ([arg.format(folder=folder) for arg in args], redirect) for name, (args, redirect) in CASES.items()}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_shell, args, redirect) for name, (args, redirect) in calls.items()}
        done = {name: future.result() for name, future in futures.items()}
    done["output_file"] = Run(0, (folder / "verdict.txt").read_text() if (folder / "verdict.txt").exists() else "",
                              "", [])
    return done


@pytest.mark.slow  # the runs fixture
def test_a_closed_stderr_keeps_the_exit_code(runs: dict[str, Run]) -> None:
    fits, fits_json = runs["stderr_closed_fits"], runs["stderr_closed_fits_json"]
    assert fits.code == 0 and "FITS" in fits.out, fits  # it was 1, "does not fit", whatever the job
    assert fits_json.code == 0 and json.loads(fits_json.out)["fits"] is True, fits_json  # no traceback on stdout
    usage, usage_json = runs["stderr_closed_usage"], runs["stderr_closed_usage_json"]
    assert usage.code == 2 and not usage.out, usage
    assert usage_json.code == 2 and json.loads(usage_json.out)["error"]["kind"] == "usage", usage_json
    assert all(not runs[name].temp for name in runs), {name: run.temp for name, run in runs.items() if run.temp}


@pytest.mark.slow  # the runs fixture
def test_a_closed_stdout_is_141_where_there_was_a_result_to_write(runs: dict[str, Run]) -> None:
    fits = runs["stdout_closed_fits"]
    assert fits.code == 141 and "Traceback" not in fits.err and "internal error" not in fits.err, fits  # it was 3
    usage = runs["stdout_closed_usage"]
    assert usage.code == 2 and "No such option" in usage.err, usage  # the error stands: it is on stderr
    to_file = runs["stdout_closed_output_file"]
    assert to_file.code == 0 and "Traceback" not in to_file.err, to_file  # nothing was to be written to stdout
    assert "FITS" in runs["output_file"].out


@pytest.mark.slow  # the runs fixture
def test_a_failing_stdout_is_3_with_one_error_line_never_1(runs: dict[str, Run]) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    for name in ("stdout_full_fits", "stdout_full_does_not_fit"):  # each was 1 with a traceback
        run = runs[name]
        assert run.code == 3, (name, run)
        errors = [line for line in run.err.splitlines() if line.startswith("Error: ")]
        assert errors == ["Error: could not write the result to standard output: No space left on device"], run
        assert "Traceback" not in run.err, run
    usage = runs["stdout_full_usage"]
    assert usage.code == 2 and "No such option" in usage.err, usage


# --- signals while the result is written, or once it is there -----------------------------------

def _full_pipe() -> tuple[int, int]:
    """A pipe already full, that nobody reads."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        while True:
            os.write(write, b"x" * 65536)
    except BlockingIOError:
        pass
    os.set_blocking(write, True)
    return read, write


def _blocked_writing(pid: int, within_s: float = 120) -> None:
    """Wait until process ``pid`` has had a child and has none left (the result came), and
    waits in a write to a pipe: its kernel wait channel says so (where /proc does not show it:
    three seconds after its child is gone)."""
    deadline = time.monotonic() + within_s
    had_child, gone_at = False, 0.0
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        had_child = had_child or bool(children)
        gone_at = 0.0 if children or not had_child else gone_at or time.monotonic()
        if gone_at and ("pipe_write" in wchan or time.monotonic() - gone_at > 3.0):
            return
        time.sleep(0.05)
    raise AssertionError(f"graphmem {pid} did not come to write its result within {within_s} s")


@pytest.mark.skipif(not Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
                    reason="reads the process's children and wait channel from /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_graphmem_blocked_writing_to_a_pipe_nobody_reads(signum: int, tmp_path: Path) -> None:
    read, write = _full_pipe()
    process = subprocess.Popen([GRAPHMEM, *FITS], cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(tmp_path)}, start_new_session=True)
    os.close(write)
    try:
        _blocked_writing(process.pid)
        os.killpg(process.pid, signum)
        sent = time.monotonic()
        _, err = process.communicate(timeout=10)  # it was blocked for ever: signals were blocked while writing
        assert time.monotonic() - sent < 2.0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        os.close(read)
    assert process.returncode == 128 + signum, err
    assert f"interrupted ({signal.Signals(signum).name}) while writing the result" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


# graphmem's child flushes stderr once more after it sent its result: this model's stderr then
# says so and waits, so the supervisor has the whole result (the --output file is in place)
# while its child lives on
STALLS_AFTER_THE_RESULT = """
import io, os, sys, time
from torch import nn

class _LastFlushWaits(io.TextIOBase):
    def __init__(self, inner):
        self.inner = inner

    def writable(self):
        return True

    def write(self, text):
        return self.inner.write(text)

    def flush(self):
        if os.path.exists(os.environ["GRAPHMEM_TEST_OUTPUT"]):
            self.inner.write("graphmem-test: the result is written\\n")
            self.inner.flush()
            time.sleep(30)
        self.inner.flush()

sys.stderr = _LastFlushWaits(sys.stderr)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)
"""


def test_sigint_once_the_whole_result_is_there_leaves_its_exit_code(tmp_path: Path) -> None:
    (tmp_path / "stalls.py").write_text(textwrap.dedent(STALLS_AFTER_THE_RESULT))
    output, temp = tmp_path / "verdict.txt", tmp_path / "temp"
    temp.mkdir()
    process = subprocess.Popen([GRAPHMEM, "check", "stalls.py:Net", "-i", "2x4", "--budget", "1GiB", "--output",
                                str(output)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(temp), "GRAPHMEM_TEST_OUTPUT": str(output)})
    assert process.stderr is not None
    seen = ""
    while "graphmem-test: the result is written" not in seen and process.poll() is None:
        seen += process.stderr.readline()
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, seen + err  # it was 130, "stopped before the result was written"
    assert "interrupted" not in err and not out, err
    assert "FITS" in output.read_text()
    assert os.listdir(temp) == []
