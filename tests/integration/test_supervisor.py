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
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.conftest import ROOT

GRAPHMEM = [sys.executable, "-m", "graphmem"]
INSTALLED = [str(Path(sys.executable).with_name("graphmem"))]  # the command a user runs
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

class ClosesFds(Net):
    def forward(self, x):
        os.closerange(3, 65536)  # graphmem's pipe to its supervisor among them
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


def _start(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None,
           command: Sequence[str] = GRAPHMEM) -> Started:
    """graphmem started as a CI runner starts it, with a temporary folder of its own."""
    marker = f"GRAPHMEM_TEST_RUN={uuid.uuid4().hex}"
    temp = Path(tempfile.mkdtemp(prefix="graphmem-test-"))
    environ = {**os.environ, "TMPDIR": str(temp), "GRAPHMEM_TEST_RUN": marker.partition("=")[2], **(env or {})}
    process = subprocess.Popen([*command, *args], cwd=cwd, env=environ, stdin=subprocess.DEVNULL,
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


def _run(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None, command: Sequence[str] = GRAPHMEM,
         timeout: float = 240) -> Run:
    started = time.monotonic()
    process, marker, temp = _start(args, cwd, env, command)
    return _finish(process, marker, temp, started, timeout=timeout)


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
        "closes_fds": ([*CHECK, "models.py:ClosesFds"], None),
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
def test_a_model_that_closes_graphmems_pipe_is_told_so(runs: dict[str, Run]) -> None:
    run = runs["closes_fds"]
    assert run.code == 3, run
    message = str(_error(run)["message"])  # it was "exited with status 0 ... (the model's code called os._exit?)"
    assert "exited with status 1 before sending one (it closed the pipe graphmem reads the result from" in message
    assert "Traceback" not in run.err, run
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


# --- graphmem run: the program's options, how its processes end, what it leaves ---------------

# a tiny training program; what else it does comes from its environment
PROGRAM = """
import ctypes, json, multiprocessing, os, signal, subprocess, sys, time
import torch

def sleep_for_ever(pid_file):
    with open(pid_file, "w") as file:
        file.write(str(os.getpid()))
    while True:
        time.sleep(1)

if __name__ == "__main__":
    print("graphmem-test argv: " + json.dumps(sys.argv), file=sys.stderr, flush=True)
    time.sleep(float(os.environ.get("SLEEP_S", "0")))
    helper, pid_file = os.environ.get("HELPER"), os.environ.get("PID_FILE", "")
    if helper == "process":  # a daemon helper process that sleeps for ever
        multiprocessing.Process(target=sleep_for_ever, args=(pid_file,), daemon=True).start()
    elif helper == "session":  # a subprocess in a session and process group of its own
        subprocess.Popen([sys.executable, "-c", f"import os, time; open({pid_file!r}, 'w').write(str(os.getpid())); "
                          "time.sleep(600)"], start_new_session=True)
    while helper and not (os.path.exists(pid_file) and os.path.getsize(pid_file)):  # the helper started
        time.sleep(0.05)
    if os.environ.get("END") == "error_at_start":
        raise RuntimeError("graphmem-test: the program fails before its first step")
    m = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    for step in range(2):
        if os.environ.get("END") == "sleep":
            print("graphmem-test: sleeping", file=sys.stderr, flush=True)
            time.sleep(600)
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        die = os.environ.get("DIE", "")
        if die == "exit1":
            ctypes.CDLL(None)._exit(1)  # libc's: no Python code runs
        elif die == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif die == "segv":
            ctypes.string_at(0)
        elif die == "close":
            os.closerange(3, 65536)
    if os.environ.get("END") == "error":
        raise RuntimeError("graphmem-test: the program fails after its steps")
"""


def _program_argv(run: Run) -> list[str]:
    line = next(line for line in run.err.splitlines() if line.startswith("graphmem-test argv: "))
    return list(json.loads(line.partition(": ")[2]))


@pytest.fixture
def program(tmp_path: Path) -> Path:
    (tmp_path / "prog.py").write_text(textwrap.dedent(PROGRAM))
    return tmp_path


@pytest.mark.slow  # three runs, one of 5 s
def test_options_after_the_script_are_the_programs(program: Path) -> None:
    """graphmem's options end at the script: the program's --timeout, --format and the rest are
    its own, in its argv, and neither graphmem's time limit nor its error output change."""
    theirs = ["--timeout", "2", "--format", "json", "--device", "cuda", "--steps", "5", "--gpu", "a100-80gb",
              "--output", "x", "-h"]
    calls: dict[str, tuple[list[str], dict[str, str]]] = {
        "theirs": (["run", "--timeout", "60s", "prog.py", *theirs], {"SLEEP_S": "3"}),  # it was killed after 2 s
        "fails": (["run", "prog.py", "--format", "json"], {"END": "error_at_start"}),  # it was a JSON document
        "timeout": (["run", "--timeout", "5s", "prog.py", "--timeout", "0"], {"END": "sleep"}),  # it was no limit
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, args, program, env, INSTALLED, 90) for name, (args, env) in calls.items()}
        runs = {name: future.result() for name, future in futures.items()}
    run = runs["theirs"]
    assert run.code == 0 and _program_argv(run) == ["prog.py", *theirs], run
    assert run.out.startswith("graphmem run") and "A100" not in run.out and "timed out" not in run.err, run
    assert not (program / "x").exists()
    fails = runs["fails"]
    assert fails.code == 3 and "Error: " in fails.err and not fails.out, fails  # graphmem's format: table
    timeout = runs["timeout"]
    assert timeout.code == 3 and "timed out after 5s (--timeout)" in timeout.err and timeout.seconds < 30, timeout
    for run in runs.values():
        _clean(run)


def test_options_after_dash_m_module_are_the_modules(program: Path) -> None:
    (program / "progmod.py").write_text((program / "prog.py").read_text())
    run = _run(["run", "-m", "progmod", "--steps", "1", "--format", "json"], program, command=INSTALLED, timeout=90)
    assert run.code == 0 and _program_argv(run)[1:] == ["--steps", "1", "--format", "json"], run
    assert run.out.startswith("graphmem run"), run


DEATHS = {"exit1": "exited with status 1", "kill": "killed by SIGKILL (out of memory?)", "segv": "killed by SIGSEGV",
          "close": "exited with status 1"}
# (close, 1 process): the program runs in graphmem's own process, whose trace code meets the closed
# descriptors first (graphmem/trace/program/run.py); a model closing them: test_a_model_that_closes...
DEATH_CASES = [(die, ranks) for die in DEATHS for ranks in (1, 2) if (die, ranks) != ("close", 1)]


# every test that takes it is marked slow: the first pays for all its commands (~40 s here)
@pytest.fixture(scope="module")
def deaths(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Run]:
    """The program's process (or one rank's) ended by libc's _exit(1), SIGKILL, a segfault, or
    closing the file descriptors it inherited."""
    folder = tmp_path_factory.mktemp("deaths")
    (folder / "prog.py").write_text(textwrap.dedent(PROGRAM))
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {(die, ranks): pool.submit(_run, ["run", "--nproc-per-node", str(ranks), "prog.py"], folder,
                                             {"DIE": die}, INSTALLED, 120) for die, ranks in DEATH_CASES}
        return {call: future.result() for call, future in futures.items()}


@pytest.mark.parametrize("die, ranks", DEATH_CASES)
@pytest.mark.slow  # the deaths fixture
def test_how_the_programs_process_ended_is_named(deaths: dict[tuple[str, int], Run], die: str, ranks: int) -> None:
    run = deaths[die, ranks]
    assert run.code == 3, run
    error = next(line for line in run.err.splitlines() if line.startswith("Error: "))
    assert DEATHS[die] in error and "died (out of memory?)" not in error, error  # it said "(out of memory?)" for all
    _clean(run)


@pytest.fixture
def pid_files() -> Iterator[Path]:
    """Where the program's helpers write their pids: /dev/shm, which graphmem run's file layer
    (graphmem.trace.program.scratch) passes through, so the files are real."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    folder = Path(tempfile.mkdtemp(prefix="graphmem-test-pids-", dir="/dev/shm"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _gone(pid_file: Path) -> None:
    pid = int(pid_file.read_text())  # the helper started
    assert not Path(f"/proc/{pid}").exists(), f"the program's helper {pid} is left"  # not even a zombie


LEAVES = {"process": ("process", "", []), "process_error": ("process", "error_at_start", []),
          "session": ("session", "", []), "session_timeout": ("session", "sleep", ["--timeout", "10s"])}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux's")
@pytest.mark.slow  # four runs, one of 10 s
def test_what_the_program_started_ends_with_the_command(program: Path, pid_files: Path) -> None:
    """A daemon helper process (it kept graphmem from ever ending) and a subprocess in a session
    of its own (it outlived graphmem): gone when the command ends, normally, with an error or at
    its --timeout, and nothing left in TMPDIR."""
    def one(name: str) -> Run:
        helper, end, options = LEAVES[name]
        return _run(["run", *options, "prog.py"], program, {"HELPER": helper, "END": end,
                                                           "PID_FILE": str(pid_files / f"{name}.pid")}, INSTALLED, 90)

    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(LEAVES, pool.map(one, LEAVES)))
    assert runs["process"].code == runs["session"].code == 0, runs
    assert runs["process_error"].code == 3 and "graphmem-test: the program fails" in runs["process_error"].err, runs
    assert runs["session_timeout"].code == 3 and "timed out after 10s" in runs["session_timeout"].err, runs
    for name, run in runs.items():
        assert run.seconds < 60, (name, run)  # a helper held graphmem until the test killed it
        _gone(pid_files / f"{name}.pid")
        _clean(run)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux's")
def test_a_signal_ends_what_the_program_started(program: Path, pid_files: Path) -> None:
    started = time.monotonic()
    process, marker, temp = _start(["run", "prog.py"], program, {"HELPER": "session", "END": "sleep",
                                                                 "PID_FILE": str(pid_files / "signal.pid")}, INSTALLED)
    seen = _wait_for(process, "graphmem-test: sleeping")
    os.killpg(process.pid, signal.SIGTERM)
    run = _finish(process, marker, temp, started, seen, timeout=30)
    assert run.code == 143, run
    _gone(pid_files / "signal.pid")
    _clean(run)


@pytest.mark.parametrize("command", [INSTALLED, GRAPHMEM], ids=["graphmem", "python -m graphmem"])
def test_a_program_run_from_a_folder_on_pythonpath_imports_its_modules_there(tmp_path: Path,
                                                                            command: list[str]) -> None:
    """As python does: PYTHONPATH's entries stay on sys.path, the current folder among them."""
    (tmp_path / "mylib.py").write_text("WIDTH = 4\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text(textwrap.dedent("""
        import torch
        import mylib  # beside the current folder, which PYTHONPATH names

        m = torch.nn.Linear(mylib.WIDTH, 4)
        opt = torch.optim.SGD(m.parameters(), 0.1)
        for _ in range(2):
            m(torch.randn(2, mylib.WIDTH)).sum().backward()
            opt.step()
            opt.zero_grad()
    """))
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    assert subprocess.run([sys.executable, "sub/train.py"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": path},
                          timeout=120).returncode == 0  # python runs it
    run = _run(["run", "sub/train.py"], tmp_path, {"PYTHONPATH": path}, command, timeout=120)
    assert run.code == 0 and "No module named" not in run.err, run  # it was "No module named 'mylib'"
    _clean(run)
