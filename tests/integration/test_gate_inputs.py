"""What a gate does with odd inputs, run as CI runs it (a real process, its exit code, stdout and
stderr apart): output paths that are not plain new files (a device, a FIFO, a hard-linked or
read-protected file, a folder written with a trailing slash, a name too long, a symbolic link
loop) and user mistakes that once were "internal error" (exit 3): dimensions past
int64, --kwargs nested past Python's limit, a config.json value of the wrong type, a mistyped
--hf-config path that was taken for a Hub id and fetched over the network.

Every refusal is exit 2 with one ``Error:`` line, before the model is built.  The runs are
independent and spend their time importing torch, so they run two at a time (about 40 s).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

pytestmark = pytest.mark.slow  # every test takes the runs fixture: all its commands, ~20-40 s, for the first

GRAPHMEM = [sys.executable, "-m", "graphmem"]

MODELS = """
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        print("user print in __init__")
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)
"""

GPT2 = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8, "vocab_size": 64, "n_positions": 16,
        "bos_token_id": 0, "eos_token_id": 0}
NET = ["analyze", "models.py:Net", "-i", "2x4"]
GPT2_RUN = ["analyze", "transformers:GPT2LMHeadModel", "-i", "input_ids=1x8:int64", "--mode", "inference"]
LONG_NAME = "a" * 240 + ".html"  # 245 bytes: a valid name, too long for ".NAME.XXXXXXXX.partial.html"


class Run(NamedTuple):
    code: int
    out: str
    err: str


def _run(args: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> Run:
    done = subprocess.run([*GRAPHMEM, *args], cwd=cwd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, **(env or {})})
    return Run(done.returncode, done.stdout, done.stderr)


def _run_all(calls: dict[str, tuple[Sequence[str], dict[str, str] | None]], cwd: Path) -> dict[str, Run]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, args, cwd, env) for name, (args, env) in calls.items()}
        return {name: future.result() for name, future in futures.items()}


class _FifoReader(threading.Thread):
    """Reads the FIFO to its end once a writer opens it (a reader waiting in open() counts as one)."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path, self.data = path, b""

    def run(self) -> None:
        with open(self.path, "rb") as fifo:
            self.data = fifo.read()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gate_inputs")
    (folder / "models.py").write_text(textwrap.dedent(MODELS))
    (folder / "loop.json").symlink_to("loop.json")
    (folder / "mistyped.json").write_text(json.dumps({**GPT2, "n_embd": "big"}))  # the config class refuses it
    (folder / "hidden.json").write_text(json.dumps({**GPT2, "hidden_size": "big"}))  # the model's constructor does
    (folder / "out").mkdir()
    report = folder / "out" / "report.txt"
    report.write_text("old")
    report.chmod(0o600)
    (folder / "out" / "graph.dot").write_text("old")
    os.link(folder / "out" / "graph.dot", folder / "out" / "graph-link.dot")
    os.mkfifo(folder / "out" / "snapshot.pickle")
    return folder


@pytest.fixture(scope="module")
def runs(work: Path) -> dict[str, Run]:
    reader = _FifoReader(work / "out" / "snapshot.pickle")
    reader.start()
    offline_or_not = {"HF_HUB_OFFLINE": "0", "HF_HOME": str(work / "hf-home"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    calls: dict[str, tuple[Sequence[str], dict[str, str] | None]] = {
        "in_place": ([*NET, "-o", "out/report.txt", "--snapshot", "out/snapshot.pickle", "--dot", "out/graph.dot",
                      "--html", f"out/{LONG_NAME}", "--format", "json"], None),
        "dev_null": ([*NET, "-o", os.devnull], None),
        "dev_stdout": ([*NET, "-o", "/dev/stdout", "--format", "json"], None),
        "trailing_slash": ([*NET, "-o", "newdir/"], None),
        "name_too_long": ([*NET, "-o", "b" * 300 + ".json"], None),
        "symlink_loop": ([*NET, "--dot", "loop.json.dot", "-o", "loop.json"], None),
        "dims_past_int64": (["analyze", "models.py:Net", "-i", "99999999999999999999x4"], None),
        "deep_kwargs": ([*NET, "--kwargs", "[" * 50_000 + "]" * 50_000], None),
        "hf_missing_file": ([*GPT2_RUN, "--hf-config", "conf/config.json"], offline_or_not),
        "hf_mistyped": ([*GPT2_RUN, "--hf-config", "mistyped.json"], None),
        "hf_hidden": ([*GPT2_RUN, "--hf-config", "hidden.json"], None),
    }
    done = _run_all(calls, work)
    reader.join(timeout=10)
    done["fifo"] = Run(0, reader.data.decode("latin-1"), "")
    return done


def _refused(run: Run, fragment: str) -> None:
    """Exit 2, one ``Error:`` line naming the fault, nothing on stdout, the model never built."""
    errors = [line for line in run.err.splitlines() if line.startswith("Error:")]
    assert run.code == 2 and len(errors) == 1 and fragment in errors[0], run
    assert "Traceback" not in run.err and "internal error" not in run.err and run.out == "", run
    assert "user print in __init__" not in run.err, run  # refused before the analysis


# --- output paths that are not plain new files (a socket: tests/unit/report/test_report_files.py) ---

def test_existing_files_devices_and_fifos_are_written_in_place(runs: dict[str, Run], work: Path) -> None:
    run = runs["in_place"]
    assert run.code == 0 and run.out == "", run
    out = work / "out"
    report = out / "report.txt"
    assert json.loads(report.read_text())["target"] == "models.py:Net"
    assert stat.S_IMODE(report.stat().st_mode) == 0o600  # was 644 once replaced
    assert "digraph" in (out / "graph-link.dot").read_text() and (out / "graph.dot").stat().st_nlink == 2
    assert stat.S_ISFIFO((out / "snapshot.pickle").stat().st_mode)  # still a FIFO, not replaced by a file
    assert runs["fifo"].out.startswith("\x80")  # the reader got the pickle through it
    assert (out / LONG_NAME).read_text().startswith("<!DOCTYPE html>")  # its temporary name was shortened
    assert sorted(os.listdir(out)) == sorted(["report.txt", "graph.dot", "graph-link.dot", "snapshot.pickle",
                                              LONG_NAME])  # no temporary file left


def test_dev_null_stays_a_device_and_dev_stdout_is_stdout(runs: dict[str, Run]) -> None:
    assert runs["dev_null"].code == 0 and runs["dev_null"].out == "", runs["dev_null"]
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)  # as root, once replaced by a regular file
    run = runs["dev_stdout"]
    assert run.code == 0 and json.loads(run.out)["target"] == "models.py:Net", run


@pytest.mark.parametrize("name, fragment", [
    ("trailing_slash", "'newdir/' ends in '/', so it names a folder"),
    ("name_too_long", "longer than its file system allows"),  # was exit 3 after the analysis
    ("symlink_loop", "its symbolic links form a loop"),
])
def test_unusable_output_paths_are_refused_before_the_analysis(runs: dict[str, Run], work: Path, name: str,
                                                               fragment: str) -> None:
    _refused(runs[name], fragment)
    assert not (work / "newdir").exists()  # a file named newdir, once


# --- user mistakes, never "internal error" ----------------------------------------------------

@pytest.mark.parametrize("name, fragment", [
    ("dims_past_int64", "'99999999999999999999x4' is too large"),
    ("deep_kwargs", "JSON nested too deeply"),
])
def test_oversized_values_are_usage_errors(runs: dict[str, Run], name: str, fragment: str) -> None:
    _refused(runs[name], fragment)


def test_a_missing_hf_config_file_is_never_fetched(runs: dict[str, Run]) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install graphmem[hf])")
    _refused(runs["hf_missing_file"], "no such file 'conf/config.json'")  # was: DNS, 5 HTTPS retries, 45 s


@pytest.mark.parametrize("name, fragment", [
    ("hf_mistyped", "GPT2Config refused the config values"),  # was exit 3, internal error
    ("hf_hidden", "check --hf-config (hidden_size='big' where GPT2Config's default is the int 768)"),
])
def test_a_config_value_of_the_wrong_type_is_named(runs: dict[str, Run], name: str, fragment: str) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install graphmem[hf])")
    errors = [line for line in runs[name].err.splitlines() if line.startswith("Error:")]
    assert runs[name].code == 2 and len(errors) == 1 and fragment in errors[0], runs[name]
    assert "Traceback" not in runs[name].err and "internal error" not in runs[name].err
