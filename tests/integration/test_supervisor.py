"""The gate as a CI runner starts it, whatever the model's code does: graphmem runs in a
session of its own (signals at their defaults, its own process group), stdout and stderr apart,
and after it ends this checks the exit code, both streams, that no process it started is left
(each run's processes carry a marker in their environment) and that its temporary folder
(TMPDIR) is empty.

The supervising process (graphmem.cli.supervisor) owns these guarantees: the model's code
cannot choose the exit code (os._exit), keep the command alive (threads), read the terminal,
put lines on stdout, or outlive a signal, a timeout or the command.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.conftest import ROOT

GRAPHMEM = [sys.executable, "-m", "graphmem"]
VERDICTS = ("FITS", "DOES NOT FIT", "fits")

MODELS = """
import os, sys, threading, time
from torch import nn

if os.environ.get("EXIT_AT_IMPORT"):
    os._exit(int(os.environ["EXIT_AT_IMPORT"]))

class Net(nn.Module):
    def __init__(self, layers=1):
        super().__init__()
        self.fc = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])

    def forward(self, x):
        return self.fc(x)

class ExitsInInit(Net):
    def __init__(self):
        os._exit(0)

class ExitsInForward(Net):
    def forward(self, x):
        os._exit(int(os.environ.get("CODE", "0")))

class LeavesAThread(Net):
    def forward(self, x):
        def chatter():
            while True:
                print("thread print", flush=True)
                time.sleep(0.05)
        threading.Thread(target=chatter).start()  # not a daemon: it would keep a process alive
        time.sleep(0.2)
        return self.fc(x)

class Sleeps(Net):
    def forward(self, x):
        print("graphmem-test: sleeping", file=sys.stderr, flush=True)
        time.sleep(600)
        return self.fc(x)

class ReadsStdin(Net):
    def forward(self, x):
        input("? ")
        return self.fc(x)
"""

SHADOW = "import sys\nprint('graphmem-test: the shadowing module ran', file=sys.stderr)\nsys.exit(7)\n"


class Run(NamedTuple):
    code: int
    out: str
    err: str
    seconds: float
    left: list[str]   # processes of this run still alive after it ended
    temp: list[str]   # what it left in its temporary folder


def _alive_with(marker: str) -> list[str]:
    """The processes whose environment carries ``marker`` (graphmem's, its child's, its workers')."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            status = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            continue
        if marker.encode() in environ and status != "Z":
            found.append(pid)
    return found


Started = tuple[subprocess.Popen[str], str, Path]


def _start(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> Started:
    """graphmem started as a CI runner starts it, with a temporary folder of its own."""
    marker = f"GRAPHMEM_TEST_RUN={uuid.uuid4().hex}"
    temp = Path(tempfile.mkdtemp(prefix="graphmem-test-"))
    environ = {**os.environ, "TMPDIR": str(temp), "GRAPHMEM_TEST_RUN": marker.partition("=")[2], **(env or {})}
    process = subprocess.Popen([*GRAPHMEM, *args], cwd=cwd, env=environ, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return process, marker, temp


def _finish(process: subprocess.Popen[str], marker: str, temp: Path, started: float, err: str = "",
            timeout: float = 240) -> Run:
    out, rest = process.communicate(timeout=timeout)
    seconds = time.monotonic() - started
    time.sleep(0.2)  # a process killed a moment ago may still be listed
    left = sorted(os.listdir(temp))
    shutil.rmtree(temp, ignore_errors=True)
    return Run(process.returncode, out, err + rest, seconds, _alive_with(marker), left)


def _run(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> Run:
    started = time.monotonic()
    process, marker, temp = _start(args, cwd, env)
    return _finish(process, marker, temp, started)


def _wait_for(process: subprocess.Popen[str], line: str) -> str:
    assert process.stderr is not None
    seen = ""
    while line not in seen and process.poll() is None:
        seen += process.stderr.readline()
    return seen


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("supervisor")
    (folder / "models.py").write_text(textwrap.dedent(MODELS))
    return folder


CHECK = ["check", "--budget", "1GiB", "-i", "2x64", "--format", "json"]


# every test that takes it is marked slow: the first pays for all its commands (~30 s here)
@pytest.fixture(scope="module")
def runs(work: Path) -> dict[str, Run]:
    """The independent runs, two at a time."""
    calls: dict[str, tuple[list[str], dict[str, str] | None]] = {
        "exit0_at_import": ([*CHECK, "models.py:Net"], {"EXIT_AT_IMPORT": "0"}),
        "exit0_in_init": ([*CHECK, "models.py:ExitsInInit"], None),
        "exit0_in_forward": ([*CHECK, "models.py:ExitsInForward"], None),
        "exit1_in_forward": ([*CHECK, "models.py:ExitsInForward"], {"CODE": "1"}),
        "thread": ([*CHECK, "models.py:LeavesAThread"], None),
        "stdin": ([*CHECK, "models.py:ReadsStdin"], None),
        "timeout": ([*CHECK, "models.py:Sleeps", "--timeout", "20s"], None),  # past start-up, even when loaded
        "bad_timeout": ([*CHECK, "models.py:Net", "--timeout", "soon"], None),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, args, work, env) for name, (args, env) in calls.items()}
        return {name: future.result() for name, future in futures.items()}


def _clean(run: Run) -> None:
    assert not run.left, f"processes left behind: {run.left}"
    assert not run.temp, f"left in the temporary folder: {run.temp}"


def _error(run: Run) -> dict[str, object]:
    document = json.loads(run.out)  # stdout is exactly one JSON document
    assert set(document) == {"error"} and document["error"]["exit_code"] == run.code, run
    return dict(document["error"])


@pytest.mark.parametrize("name", ["exit0_at_import", "exit0_in_init", "exit0_in_forward", "exit1_in_forward"])
@pytest.mark.slow  # the runs fixture
def test_the_models_code_cannot_choose_the_exit_code(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    assert run.code == 3, run
    error = _error(run)
    assert error["kind"] == "analysis" and "ended without a result" in str(error["message"]), error
    assert "exited with status" in str(error["message"]), error
    assert not any(v in run.out for v in VERDICTS[:2]) and "Traceback" not in run.err, run
    _clean(run)


@pytest.mark.slow  # the runs fixture
def test_a_thread_the_model_leaves_running_neither_keeps_the_command_alive_nor_writes_stdout(
        runs: dict[str, Run]) -> None:
    run = runs["thread"]
    assert run.code == 0 and json.loads(run.out)["fits"] is True, run  # one JSON document, nothing after it
    assert "thread print" in run.err and "thread print" not in run.out
    _clean(run)


@pytest.mark.slow  # the runs fixture
def test_the_models_code_cannot_wait_on_the_terminal(runs: dict[str, Run]) -> None:
    run = runs["stdin"]
    assert run.code in (2, 3) and "EOF" in run.err, run  # stdin is /dev/null: input() fails at once
    _clean(run)


@pytest.mark.slow  # the runs fixture
def test_timeout_ends_the_command_naming_where_it_was(runs: dict[str, Run]) -> None:
    run = runs["timeout"]
    assert run.code == 3, run
    error = _error(run)
    assert "timed out after 20s" in str(error["message"]) and "recording" in str(error["message"]), error
    assert run.seconds < 25, run  # 20 s from the start, and the end
    _clean(run)
    bad = runs["bad_timeout"]
    assert bad.code == 2 and "--timeout" in bad.err and "not a duration" in bad.err, bad


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_ends_the_whole_tree_within_two_seconds(work: Path, signum: int) -> None:
    """Sent where the model's code sleeps (no safe point for minutes), to the process group, as
    a terminal or a CI runner sends it."""
    started = time.monotonic()
    process, marker, temp = _start([*CHECK, "models.py:Sleeps"], work)
    seen = _wait_for(process, "graphmem-test: sleeping")
    os.killpg(process.pid, signum)
    sent = time.monotonic()
    run = _finish(process, marker, temp, started, seen, timeout=30)
    assert time.monotonic() - sent < 2.5, run
    assert run.code == 128 + signum, run
    assert _error(run)["kind"] == "interrupted" and signal.Signals(signum).name in run.err, run
    _clean(run)


def test_a_second_signal_ends_it_at_once(work: Path) -> None:
    started = time.monotonic()
    process, marker, temp = _start([*CHECK, "models.py:Sleeps"], work)
    seen = _wait_for(process, "graphmem-test: sleeping")
    os.killpg(process.pid, signal.SIGTERM)
    os.killpg(process.pid, signal.SIGTERM)
    run = _finish(process, marker, temp, started, seen, timeout=30)
    assert run.code == 143, run
    _clean(run)


# --- signals at random moments, from the first millisecond ----------------------------------

GPT = ["examples/gpt.py:GPT", "--input", "4x128:int64", "--loss", "cross_entropy", "--budget", "10GiB"]
COMMANDS = {
    "check": ["check", *GPT],
    "plan": ["plan", *GPT],
    "zero1": ["check", "examples/mlp.py:MLP", "--input", "32x1000", "--budget", "1GiB", "--parallel", "zero1=8"],
}


def _signalled(command: str, delay: float, signum: int) -> tuple[str, float, int, Run]:
    started = time.monotonic()
    process, marker, temp = _start(COMMANDS[command], ROOT)
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):  # it may have ended already
        os.killpg(process.pid, signum)
    sent = time.monotonic()
    run = _finish(process, marker, temp, started, timeout=60)
    return command, delay, signum, run._replace(seconds=time.monotonic() - sent)


def _finished_first(run: Run) -> bool:
    """The command had written its result when the signal came: it stands (the supervisor
    blocks signals once it writes the result), and nothing is left behind."""
    return run.code in (0, 1) and "interrupted" not in run.err and not run.left and not run.temp and (
        "FITS" in run.out or "graphmem plan" in run.out)


def _ended_as_item_3_says(delay: float, signum: int, run: Run) -> bool:
    """Exit 128 + the signal with no verdict, within 2 s (plus the 0.2 s this test waits),
    nothing left behind.  In the first milliseconds, while Python itself starts and before it
    runs graphmem's first line, the signal ends the process by itself (a shell shows 128 + N),
    or Python's start-up reports the KeyboardInterrupt itself: no graphmem output either way."""
    if delay < 0.3 and not run.out and "Error:" not in run.err and (
            run.code == -signum or (signum == signal.SIGINT and "KeyboardInterrupt" in run.err)):
        ended = True
    else:
        ended = (run.code == 128 + signum and "Traceback" not in run.err
                 and not any(v in run.out for v in VERDICTS[:2]) and "fits" not in run.out.lower())
    return ended and run.seconds < 2.5 and not run.left and not run.temp


@pytest.mark.slow
def test_signals_at_random_moments_end_every_command_cleanly() -> None:
    """8 trials per command, 3 of them in the first second, the rest within the first 4 s
    (start-up takes about 3, the commands a few more): most land in the recording (each run
    draws new moments: over many runs, every moment is tried)."""
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    trials = [(command, round(rng.uniform(0.0, 1.0) if i < 3 else rng.uniform(0.0, 4.0), 3),
               (signal.SIGINT, signal.SIGTERM)[i % 2])
              for command in COMMANDS for i in range(8)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(lambda t: _signalled(*t), trials))
    interrupted = [o for o in outcomes if not _finished_first(o[3])]
    bad = [o for o in interrupted if not _ended_as_item_3_says(o[1], o[2], o[3])]
    note = f"seed {seed}: " + "\n".join(f"{c} {d}s {signal.Signals(s).name}: exit {r.code}, {r.seconds:.2f}s after, "
                                        f"left {r.left}, temp {r.temp}, stderr {r.err[-300:]!r}"
                                        for c, d, s, r in bad)
    assert not bad, note
    for command in COMMANDS:  # the trials did interrupt: not all came after the result
        assert sum(o[0] == command for o in interrupted) >= 3, (command, seed)


# --- no surprise imports, no files left ------------------------------------------------------

def test_a_module_in_the_current_folder_does_not_shadow_graphmems_imports(tmp_path: Path) -> None:
    (tmp_path / "transformers.py").write_text(SHADOW)
    run = _run(["check", "--preset", "gpt2", "--mode", "inference", "--input", "input_ids=1x8:int64",
                "--budget", "80GiB"], tmp_path)
    assert run.code == 0 and "FITS" in run.out, run
    assert "shadowing module ran" not in run.err


def test_no_caches_beside_the_model_or_in_home(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "models.py").write_text(textwrap.dedent(MODELS))
    home = tmp_path / "home"
    home.mkdir()
    run = _run(["analyze", "models.py:Net", "-i", "2x64", "--timeline", "t.png"], tmp_path,
               {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "MPLCONFIGDIR": ""})
    assert run.code == 0, run
    assert (tmp_path / "t.png").is_file()
    assert not (tmp_path / "__pycache__").exists()
    assert list(home.rglob("*")) == []
    _clean(run)
