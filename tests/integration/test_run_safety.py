"""graphmem run is safe to run on a user's folder: the program's writes never reach the user's
files (it sees them itself), the program starts once whatever graphmem tries while recording,
and a program that fails after its steps is never reported as a success.

Each program here runs through the installed command (the supervisor included), from a folder
of real files whose bytes are checked after the run; where a byte count matters it is compared
with the same program run for real (tests/oracles.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from graphmem.job.program import make_program
from graphmem.trace.program.run import trace_program
from tests.oracles import measure_program

GRAPHMEM = [sys.executable, "-m", "graphmem"]

STEPS = """
import torch
from torch import nn

def train(model, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
"""


def _run(folder: Path, *args: str, env: dict[str, str] | None = None,
         timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GRAPHMEM, "run", *args], cwd=folder, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _digests(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` -> its sha256 (folders as themselves)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        found[key] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "folder"
    return found


def _program(folder: Path, body: str, name: str = "prog.py") -> Path:
    script = folder / name
    script.write_text(STEPS + textwrap.dedent(body))
    return script


def _user_files(folder: Path) -> None:
    """A folder as a user has it: checkpoints, a log, data, a run folder (random bytes)."""
    for name in ("ckpt.pt", "latest.pt", "model.pt", "state.pkl", "arr.npy", "old.txt", "old2.txt"):
        (folder / name).write_bytes(os.urandom(4096))
    (folder / "train.log").write_text("line 1\nline 2\n")
    for sub in ("runs/a", "cache/deep"):
        (folder / sub).mkdir(parents=True)
        (folder / sub / "file.bin").write_bytes(os.urandom(1000))
    (folder / "manifest.json").write_text(json.dumps(
        {p.name: p.read_bytes().hex() for p in folder.iterdir() if p.is_file()}))


PROBES = """
import json, os, pickle, shutil, sys
from pathlib import Path
import numpy as np

before = {k: bytes.fromhex(v) for k, v in json.load(open("manifest.json")).items()}

def check(ok, what):
    if not ok:
        sys.exit(f"the program's view is wrong: {what}")

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
# a checkpoint saved through a file object, over a real one
with open("ckpt.pt", "wb") as f:
    torch.save(model.state_dict(), f)
# pickle through a file object
with open("state.pkl", "wb") as f:
    pickle.dump({"step": 1}, f)
check(pickle.load(open("state.pkl", "rb")) == {"step": 1}, "pickle read back")
# a rotation: latest -> prev, then a new latest
os.rename("latest.pt", "prev.pt")
check(open("prev.pt", "rb").read() == before["latest.pt"], "the rotated checkpoint")
torch.save(model.state_dict(), "latest.pt")
check(os.path.exists("latest.pt"), "the new latest")
# an atomic save: a temporary file, then os.replace over the real one
torch.save(model.state_dict(), "model.pt.tmp")
os.replace("model.pt.tmp", "model.pt")
check(not os.path.exists("model.pt.tmp") and os.path.exists("model.pt"), "the atomic save")
# an append to a log
with open("train.log", "a") as f:
    f.write("line 3\\n")
check(open("train.log").read() == "line 1\\nline 2\\nline 3\\n", "the appended log")
# deletes
os.remove("old.txt")
Path("old2.txt").unlink()
check(not os.path.exists("old.txt") and not Path("old2.txt").exists(), "the deleted files")
# a folder renamed, a folder removed and made again
os.rename("runs/a", "runs/b")
check(open("runs/b/file.bin", "rb").read() and not os.path.exists("runs/a"), "the renamed folder")
shutil.rmtree("cache")
os.makedirs("cache")
Path("cache/new.txt").write_text("new")
check(os.listdir("cache") == ["new.txt"], "the folder made again")
# numpy over a real file
np.save("arr.npy", np.arange(3))
check(list(np.load("arr.npy")) == [0, 1, 2], "numpy's file read back")
print("VIEW OK", file=sys.stderr)
train(model)
"""


def test_the_users_files_are_never_changed_and_the_program_sees_its_own_writes(tmp_path: Path) -> None:
    """Every probe of issue 44: the program sees each of its writes; after the run every real
    file is byte-identical, no file was added or removed, and the report lists the writes."""
    _user_files(tmp_path)
    _program(tmp_path, PROBES)
    before = _digests(tmp_path)
    done = _run(tmp_path, "--format", "json", "prog.py")
    assert done.returncode == 0, done.stderr
    assert "VIEW OK" in done.stderr
    assert _digests(tmp_path) == before
    report = json.loads(done.stdout)
    wrote = {(Path(c["path"]).name, c["action"]) for c in report["program_files"]}
    assert ("ckpt.pt", "overwritten") in wrote and ("old.txt", "deleted") in wrote
    assert ("train.log", "appended") in wrote


def test_a_save_pretrained_over_a_real_sharded_checkpoint(tmp_path: Path) -> None:
    """transformers' save_pretrained over a real folder: the program runs to its steps and the
    folder is as it was (its config.json included)."""
    pytest.importorskip("transformers")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json"):
        (checkpoint / name).write_bytes(os.urandom(2048))
    _program(tmp_path, """
        from transformers import GPT2Config, GPT2LMHeadModel
        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
        lm = GPT2LMHeadModel(config)
        lm.save_pretrained("ckpt", max_shard_size="50KB")
        opt = torch.optim.AdamW(lm.parameters())
        for _ in range(2):
            lm(torch.randint(0, 128, (2, 16)), labels=torch.randint(0, 128, (2, 16))).loss.backward()
            opt.step()
            opt.zero_grad()
    """)
    before = _digests(tmp_path)
    done = _run(tmp_path, "prog.py")
    assert done.returncode == 0, done.stderr
    assert _digests(tmp_path) == before


RUN_ONCE = """
import sys
print("START", file=sys.stderr, flush=True)
with open("run.log", "a") as f:
    f.write("started\\n")

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        return torch.relu(self.fc(x))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(8):
            self.blocks.append(Block())

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

net = Net()
print("BUILT", file=sys.stderr, flush=True)
last = net.blocks[7]  # a model cut to four blocks has no eighth: the cut recording cannot stand
print("LOG LINES", len(open("run.log").read().splitlines()), file=sys.stderr, flush=True)
train(net)
"""


def test_a_program_starts_once_when_its_cut_recording_does_not_stand(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """8 alike blocks, recorded as four until the program reads its eighth block: the recording
    goes on whole from the moment the fifth block was started, in the process kept whole there.
    The program's first lines ran once (one START, one line in its log, as it sees it), what the
    cut try printed after the fork is not shown, the real folder is unchanged, and the peak is
    the real run's."""
    script = _program(tmp_path, RUN_ONCE)
    before = _digests(tmp_path)
    done = _run(tmp_path, "prog.py")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("START") == 1 and done.stderr.count("BUILT") == 1
    assert "LOG LINES 1" in done.stderr
    assert _digests(tmp_path) == before
    monkeypatch.chdir(tmp_path)
    traced = trace_program(make_program(str(script)), cut=True)
    assert traced.cut is None  # recorded whole, by the backup
    real = measure_program(str(script), [], 2)
    (tmp_path / "run.log").unlink()
    from graphmem import run_program
    predicted = run_program(str(script)).train
    assert predicted is not None and predicted.peak_bytes == real.peak_bytes


EXITS = {
    "sys.exit(1)": "exited with status 1",
    "sys.exit('fatal: the data ran out')": "exited with status 1 (fatal: the data ran out)",
    "raise SystemExit(2)": "exited with status 2",
    "os._exit(1)": "called os._exit(1)",
    "raise RuntimeError('lost the data')": "raised RuntimeError: lost the data",
}


@pytest.mark.parametrize("how", list(EXITS))
def test_a_program_that_fails_after_a_step_is_never_a_success(tmp_path: Path, how: str) -> None:
    """After its first step the program fails: graphmem prints what it recorded, names how the
    program ended, exits 3, and gives no verdict even with --budget."""
    _program(tmp_path, f"""
        import os, sys
        model = nn.Linear(64, 64)
        train(model, steps=1)
        {how}
    """)
    done = _run(tmp_path, "--budget", "1GiB", "prog.py")
    assert done.returncode == 3, done.stderr
    assert EXITS[how] in done.stderr and "after 1 optimizer step" in done.stderr
    assert "peak" in done.stdout and "The program failed" in done.stdout
    assert "FITS" not in done.stdout and "Will it fit" not in done.stdout
    if "fatal" in how:  # the program's own message, as python prints it
        assert "fatal: the data ran out\n" in done.stderr


def test_a_forked_helper_that_exits_is_not_the_program_ending(tmp_path: Path) -> None:
    """The program forks a helper that exits with sys.exit(0): the program goes on to its steps."""
    _program(tmp_path, """
        import os, sys
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        os.waitpid(pid, 0)
        train(nn.Linear(64, 64))
    """)
    done = _run(tmp_path, "prog.py")
    assert done.returncode == 0, done.stderr
    assert "peak" in done.stdout


def test_a_folder_with_main_runs_as_python_runs_it(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    _program(tmp_path / "app", "train(nn.Linear(64, 64))\n", name="__main__.py")
    done = _run(tmp_path, "app")
    assert done.returncode == 0, done.stderr
    assert "peak" in done.stdout


LOADER = """
from torch.utils.data import DataLoader, TensorDataset
data = TensorDataset(torch.randn(64, 64))
loader = DataLoader(data, batch_size=8, num_workers={workers}, persistent_workers={persistent})
model = nn.Linear(64, 64)
opt = torch.optim.Adam(model.parameters())
for epoch in range(2):
    for (x,) in loader:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.mark.parametrize("persistent", [False, True])
def test_data_loader_workers_load_the_same_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   persistent: bool) -> None:
    """DataLoader(num_workers=2), persistent or not: the batches reach the recording, and each
    step's peak equals the real run of the same program loading in its process (num_workers=0).
    (A real run with workers also holds the batches that arrived ahead of their turn, in shared
    memory: how many depends on which worker was faster; docs/run.md.)"""
    monkeypatch.chdir(tmp_path)
    script = _program(tmp_path, LOADER.format(workers=2, persistent=persistent), name="workers.py")
    in_process = _program(tmp_path, LOADER.format(workers=0, persistent=False), name="in_process.py")
    real = measure_program(str(in_process), [], 3)
    from graphmem import run_program
    predicted = run_program(str(script), steps=3).train
    assert predicted is not None
    assert list(predicted.iteration_peaks) == [real.phase_peaks[f"step {k + 1}"] for k in range(3)]
    assert any("worker processes" in note for note in predicted.assumptions)


def test_the_network_is_off_unless_allowed(tmp_path: Path) -> None:
    """A loopback server: the program's connection is refused by default (it says so itself),
    and reaches the server with --allow-network."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received: list[bytes] = []

    def serve() -> None:
        server.settimeout(60)
        try:
            connection, _ = server.accept()
            received.append(connection.recv(100))
            connection.close()
        except OSError:
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    _program(tmp_path, f"""
        import socket, sys
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=5).sendall(b"hello")
            print("CONNECTED", file=sys.stderr)
        except OSError as exc:
            print("REFUSED", exc, file=sys.stderr)
        train(nn.Linear(64, 64))
    """)
    done = _run(tmp_path, "prog.py")
    assert done.returncode == 0 and "REFUSED" in done.stderr and "--allow-network" in done.stderr
    assert not received
    done = _run(tmp_path, "--allow-network", "prog.py")
    assert done.returncode == 0 and "CONNECTED" in done.stderr, done.stderr
    thread.join(10)
    server.close()
    assert received == [b"hello"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_a_program_killed_by_a_signal_is_named(tmp_path: Path, sig: signal.Signals) -> None:
    _program(tmp_path, f"""
        import os
        train(nn.Linear(64, 64), steps=1)
        os.kill(os.getpid(), {int(sig)})
    """)
    done = _run(tmp_path, "--budget", "1GiB", "prog.py")
    assert done.returncode == 3
    assert sig.name in done.stderr and "FITS" not in done.stdout


def test_write_through_lets_the_program_write_what_the_user_names(tmp_path: Path) -> None:
    """--write-through PATH: the program's metrics file there is written for real (what it
    printed from torch.cuda's counters, say); its other writes still stay in its layer."""
    (tmp_path / "ckpt.pt").write_bytes(os.urandom(1024))
    _program(tmp_path, """
        import json, os
        os.makedirs("metrics", exist_ok=True)
        with open("metrics/run.json", "w") as f:
            json.dump({"started": True}, f)
        with open("ckpt.pt", "wb") as f:
            f.write(b"")
        train(nn.Linear(64, 64))
    """)
    before = (tmp_path / "ckpt.pt").read_bytes()
    done = _run(tmp_path, "--write-through", "metrics", "prog.py")
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "metrics" / "run.json").read_text()) == {"started": True}
    assert (tmp_path / "ckpt.pt").read_bytes() == before
