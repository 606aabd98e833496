"""Public training programs, unchanged (tests/programs/wild/, listed with their repositories,
commits, licences and command lines in tests/programs/wild/SOURCE.md): each run for real and with
graphmem run on the CPU, the peak and each step's peak compared to the byte; each run with
``graphmem run --gpu h100-80gb --device cuda`` where it can take a cuda device, to the end; and no file
of the program's folder changed by graphmem run.

Ground truth: tests/oracles.py's ``measure_program`` (live storages counted op by op from the
program's first line to the end of its K-th optimizer step), in this process. A program that
updates its parameters itself, with no torch.optim optimizer (word_language_model's SGD by hand,
regression), is counted by ``measure_by_hand`` below: step k ends where docs/run.md says
graphmem run ends it, at the first module call after the k-th backward pass.

Each program's data is made by tests/programs/wild/make_data.py in the test's temporary folder,
and its settings go in as its own arguments, config files or environment, so each real run takes
seconds. The libraries a program imports are imported before both runs (their import-time
tensors count in neither); the program's own modules are imported afresh by each run.

A program whose comparison fails today is marked ``xfail(strict=True)`` with the failure: the
day graphmem handles it, the mark fails and is removed. A program that is slow on 2 cores runs
only with GRAPHMEM_EXTENDED=1. A program whose files are not in tests/programs/wild/ (they are
fetched as SOURCE.md says; they are not part of this repository) is skipped, saying so; so is one
whose libraries (torchvision, tensorboard) are not installed."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from graphmem import run_program
from graphmem.cli import main
from tests.conftest import ROOT
from tests.optional import extended
from tests.oracles import LiveStorages, Measured, measure_program
from tests.programs.wild import make_data

WILD = ROOT / "tests" / "programs" / "wild"


@dataclass(frozen=True)
class Setup:
    """What a program's run needs, made in its temporary folder."""
    argv: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    path: list[Path] = field(default_factory=list)  # on sys.path, as `pip install -e` puts a repository's package


@dataclass(frozen=True)
class Wild:
    id: str
    script: str                                   # under tests/programs/wild/
    setup: Callable[[Path], Setup]                # tmp folder -> the run's arguments, folder, environment
    libraries: tuple[str, ...] = ()               # imported before both runs; the test skips where one is missing
    steps: int = 2
    by_hand: bool = False                         # no torch.optim optimizer: measure_by_hand
    cpu: tuple[Any, ...] = ()                     # marks of the CPU comparison (xfail, extended)
    gpu_argv: tuple[str, ...] | None = ()         # appended for the GPU run; None: the program runs on the CPU only
    gpu: tuple[Any, ...] = ()                     # marks of the GPU run
    nproc: int | None = None                      # torchrun --nproc-per-node (the GPU run)
    real_cpu: bool = True                         # False: it needs a GPU (a --gpu-only program)
    ranks_env: dict[str, str] | None = None       # also on 2 gloo ranks as torchrun starts it, with this environment
    ranks: tuple[Any, ...] = ()                   # marks of the 2-rank comparison
    files: tuple[Any, ...] = ()                   # marks of the files check

    @property
    def folder(self) -> Path:
        """The program's repository folder under tests/programs/wild/."""
        return WILD / self.script.split("/")[0]


# ---------------------------------------------------------------------------------------------
# the programs' set-ups


def _work(tmp: Path) -> Path:
    cwd = tmp / "work"
    cwd.mkdir(parents=True, exist_ok=True)
    return cwd


def word_lm(*extra: str) -> Callable[[Path], Setup]:
    def setup(tmp: Path) -> Setup:
        data = make_data.wikitext(tmp / "wikitext-2")
        return Setup(["--data", str(data), "--epochs", "1", "--save", str(tmp / "model.pt"), *extra], _work(tmp))
    return setup


def sine(tmp: Path) -> Setup:
    cwd = _work(tmp)
    make_data.sine_waves(cwd)
    # torch.load's default weights_only=True (torch >= 2.6) refuses the program's numpy array;
    # the environment variable torch reads restores the load the program was written for
    return Setup(["--steps", "2"], cwd, {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1", "MPLBACKEND": "Agg"})


def plain(*argv: str) -> Callable[[Path], Setup]:
    return lambda tmp: Setup(list(argv), _work(tmp))


def gat(tmp: Path) -> Setup:
    cwd = _work(tmp)
    make_data.cora(cwd)
    return Setup(["--epochs", "3", "--hidden-dim", "8", "--num-heads", "2"], cwd)


def mnist(*argv: str) -> Callable[[Path], Setup]:
    def setup(tmp: Path) -> Setup:
        make_data.mnist(tmp / "data")  # the examples read '../data' from their working folder
        return Setup(list(argv), _work(tmp))
    return setup


def nanogpt(*extra: str, config: str | None = None) -> Callable[[Path], Setup]:
    """nanoGPT runs from its own folder (train.py execs ./configurator.py); its data, config file
    and out_dir are in the temporary folder (data_dir = os.path.join('data', dataset): an absolute
    dataset is that folder)."""
    def setup(tmp: Path) -> Setup:
        data = make_data.nanogpt_dataset(tmp / "tiny_chars")
        first = config or str(make_data.nanogpt_config(tmp, data, tmp / "out"))
        return Setup([first, *extra], WILD / "nanoGPT")
    return setup


def nanogpt_shakespeare(tmp: Path) -> Setup:
    """The repository's own config/train_shakespeare_char.py, made tiny on the command line."""
    data = make_data.nanogpt_dataset(tmp / "tiny_chars")
    return Setup(["config/train_shakespeare_char.py", f"--dataset={data}", f"--out_dir={tmp / 'out'}",
                  "--device=cpu", "--compile=False", "--dtype=float32", "--eval_iters=2", "--batch_size=4",
                  "--block_size=32", "--n_layer=2", "--n_head=2", "--n_embd=48", "--max_iters=4"], WILD / "nanoGPT")


def mingpt(project: str, *extra: str) -> Callable[[Path], Setup]:
    def setup(tmp: Path) -> Setup:
        cwd = _work(tmp)
        if project == "chargpt":
            make_data.chargpt_input(cwd)
        # its work_dir stays the default ./out/<project>, in the temporary folder: a value with a
        # "/" is not one its command line takes (literal_eval raises SyntaxError, it catches ValueError)
        return Setup(["--trainer.num_workers=0", *extra], cwd, path=[WILD / "minGPT"])
    return setup


def makemore(kind: str) -> Callable[[Path], Setup]:
    def setup(tmp: Path) -> Setup:
        cwd = _work(tmp)
        names = make_data.names(tmp / "names.txt")
        return Setup(["-i", str(names), "-o", str(tmp / "out"), "--type", kind, "--num-workers", "0",
                      "--max-steps", "5"], cwd)
    return setup


def lightning_wikitext(tmp: Path) -> Setup:
    cwd = _work(tmp)
    make_data.lightning_wikitext(cwd)
    return Setup([], cwd, {"PL_TRAINER_ENABLE_PROGRESS_BAR": "0", "PL_TRAINER_LOGGER": "0"})


def lightning_boring(tmp: Path) -> Setup:
    return Setup([], _work(tmp), {"PL_TRAINER_ENABLE_PROGRESS_BAR": "0"})


def ddp_tutorial(tmp: Path) -> Setup:
    return Setup(["2", "1", "--batch_size", "32"], _work(tmp))


# Lightning's Trainer takes the arguments the program does not give from PL_TRAINER_*, Fabric from LT_*
# (and LT_CLI_USED, as `fabric run --accelerator cpu --devices 2 --strategy ddp` sets them before
# it starts torchrun): DDP on the CPU (gloo) over the processes torchrun started
PL_DDP = {"PL_TRAINER_ACCELERATOR": "cpu", "PL_TRAINER_DEVICES": "2", "PL_TRAINER_STRATEGY": "ddp"}
FABRIC_DDP = {"LT_ACCELERATOR": "cpu", "LT_DEVICES": "2", "LT_STRATEGY": "ddp", "LT_CLI_USED": "1"}
TORCHVISION = ("torchvision",)
LIGHTNING = ("lightning",)

def fails(reason: str) -> Any:
    """The comparison fails today, as ``reason`` says (strict: it fails the day it passes)."""
    return pytest.mark.xfail(strict=True, reason=reason)


SLOW_LBFGS = extended("one LBFGS step of up to 20 closure calls over 12 time steps: 40 s real + 45 s graphmem run")
SLOW_CHARGPT = extended("after its first step chargpt samples 500 characters one forward at a time: 90 s real + 90 s "
                        "graphmem run")
SLOW_RANKS = extended("2 gloo processes for real and 2 recorded ranks: 30-60 s")

PROGRAMS = [
    Wild("word-lm-lstm", "pytorch-examples/word_language_model/main.py", word_lm(), by_hand=True,
         gpu_argv=("--accel",)),
    Wild("word-lm-adamw", "pytorch-examples/word_language_model/main.py", word_lm("--use-optimizer"),
         gpu_argv=("--accel",)),
    Wild("word-lm-transformer", "pytorch-examples/word_language_model/main.py",
         word_lm("--model", "Transformer", "--use-optimizer"), gpu_argv=("--accel",)),
    Wild("word-lm-gru-sgd", "pytorch-examples/word_language_model/main.py", word_lm("--model", "GRU", "--tied"),
         by_hand=True, gpu_argv=("--accel",)),
    # one LBFGS step (up to 20 evaluations of its closure): after it the program predicts 1,000
    # values one by one and plots them, minutes under the real run's count of live storages
    Wild("time-sequence-lbfgs", "pytorch-examples/time_sequence_prediction/train.py", sine, libraries=("matplotlib",),
         steps=1, gpu_argv=None, cpu=(SLOW_LBFGS,), files=(SLOW_LBFGS,)),
    Wild("regression", "pytorch-examples/regression/main.py", plain(), by_hand=True, gpu_argv=None,
         cpu=(fails("`loss = output.item()` is taken as 0, so `if loss < 1e-3: break` ends the loop after 1 step: "
                    "graphmem run 1,192 B [1,192] vs the real run's 1,980 B [1,980, 1,980]"),)),
    Wild("gat", "pytorch-examples/gat/main.py", gat),
    Wild("mnist", "pytorch-examples/mnist/main.py", mnist("--epochs", "1", "--batch-size", "32"),
         libraries=TORCHVISION),
    Wild("vae", "pytorch-examples/vae/main.py", mnist("--epochs", "1"), libraries=TORCHVISION),
    Wild("mnist-rnn", "pytorch-examples/mnist_rnn/main.py", mnist("--epochs", "1", "--batch-size", "32"),
         libraries=TORCHVISION, gpu_argv=("--accel",)),
    Wild("dcgan", "pytorch-examples/dcgan/main.py",
         plain("--dataset", "fake", "--workers", "0", "--batchSize", "8", "--niter", "1", "--ngf", "16", "--ndf", "16",
               "--outf", "."), libraries=TORCHVISION, steps=4, gpu_argv=("--accel",),
         cpu=(fails("graphmem run is 56 to 84 B below the real run at each of its 4 optimizer steps (netD, netG, "
                    "netD, netG): [8,130,672, 11,289,256, 14,373,288, 12,138,924] vs [8,130,728, 11,289,340, "
                    "14,373,372, 12,139,008]"),)),
    Wild("imagenet-resnet18", "pytorch-examples/imagenet/main.py",
         plain("--dummy", "-a", "resnet18", "-b", "4", "-j", "0", "--epochs", "1"), libraries=TORCHVISION),
    Wild("ddp-tutorial-torchrun", "pytorch-examples/distributed/ddp-tutorial-series/multigpu_torchrun.py",
         ddp_tutorial, nproc=2, real_cpu=False),
    Wild("fsdp2-example", "pytorch-examples/distributed/FSDP2/example.py", plain(), nproc=2, real_cpu=False),
    Wild("tensor-parallel-example", "pytorch-examples/distributed/tensor_parallelism/tensor_parallel_example.py",
         plain(), nproc=2, real_cpu=False),
    Wild("nanogpt-tiny", "nanoGPT/train.py", nanogpt(), gpu_argv=("--device=cuda",)),
    Wild("nanogpt-shakespeare-char", "nanoGPT/train.py", nanogpt_shakespeare,
         gpu_argv=("--device=cuda", "--dtype=float16")),
    Wild("nanogpt-ddp", "nanoGPT/train.py", nanogpt("--backend=gloo", "--device=cuda", "--dtype=bfloat16"), nproc=2,
         real_cpu=False),
    Wild("mingpt-chargpt", "minGPT/projects/chargpt/chargpt.py",
         mingpt("chargpt", "--model.model_type=gpt-nano", "--data.block_size=32", "--trainer.batch_size=8"),
         cpu=(SLOW_CHARGPT,), gpu=(SLOW_CHARGPT,), files=(SLOW_CHARGPT,)),
    Wild("mingpt-adder", "minGPT/projects/adder/adder.py",
         mingpt("adder", "--data.ndigit=1", "--trainer.batch_size=16")),
    Wild("makemore-transformer", "makemore/makemore.py", makemore("transformer"), libraries=("tensorboard",),
         gpu_argv=("--device", "cuda")),
    Wild("makemore-rnn", "makemore/makemore.py", makemore("rnn"), libraries=("tensorboard",),
         gpu_argv=("--device", "cuda")),
    Wild("makemore-mlp", "makemore/makemore.py", makemore("mlp"), libraries=("tensorboard",),
         gpu_argv=("--device", "cuda")),
    Wild("makemore-bow", "makemore/makemore.py", makemore("bow"), libraries=("tensorboard",),
         gpu_argv=("--device", "cuda")),
    Wild("lightning-bug-report", "pytorch-lightning/examples/pytorch/bug_report/bug_report_model.py",
         lightning_boring, libraries=LIGHTNING, steps=1, ranks_env=PL_DDP, ranks=(SLOW_RANKS,)),
    Wild("lightning-transformer", "pytorch-lightning/examples/pytorch/basics/transformer.py", lightning_wikitext,
         libraries=LIGHTNING, ranks_env=PL_DDP, ranks=(SLOW_RANKS,)),
    Wild("fabric-language-model", "pytorch-lightning/examples/fabric/language_model/train.py", lightning_wikitext,
         libraries=LIGHTNING, ranks_env=FABRIC_DDP, ranks=(SLOW_RANKS,)),
]
BY_ID = {p.id: p for p in PROGRAMS}


# ---------------------------------------------------------------------------------------------
# running a program in this process


def _present(program: Wild) -> None:
    if not (WILD / program.script).is_file():
        pytest.skip(f"{program.script} is not here: fetch it as tests/programs/wild/SOURCE.md says")
    if importlib.util.find_spec("torchvision") is not None:
        _torchvision()  # Lightning and others import it where it is installed
    for name in program.libraries:
        if name == "torchvision":
            _torchvision()
        elif importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed (pip install {name})")
        else:
            importlib.import_module("torch.utils.tensorboard" if name == "tensorboard" else name)


def _torchvision() -> None:
    """Import torchvision, as the programs do. The registry's torchvision for torch 2.13 is a CUDA
    build whose operator library does not load with the CPU torch; its import then stops at the two
    operators it gives fake kernels unconditionally (torchvision/_meta_registrations.py:
    torchvision::nms and torchvision::qnms). Their schemas are defined first, as the library would
    define them; no program here calls them."""
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed (pip install --no-deps torchvision==0.28.0: torch stays)")
    if "torchvision" not in sys.modules and not hasattr(torch.ops.torchvision, "nms"):
        global _LIBRARY
        _LIBRARY = torch.library.Library("torchvision", "DEF")
        for name in ("nms", "qnms"):
            _LIBRARY.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    importlib.import_module("torchvision")
    importlib.import_module("torchvision.datasets")


_LIBRARY: Any = None


@contextlib.contextmanager
def _running(program: Wild, setup: Setup, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The program's folder, environment and path; its own modules forgotten before and after, so
    each run imports them afresh (and programs' alike-named model.py / data.py do not mix)."""
    with monkeypatch.context() as patch:
        patch.chdir(setup.cwd)
        for name, value in {"HF_HUB_OFFLINE": "1", **setup.env}.items():
            patch.setenv(name, value)
        for entry in setup.path:
            patch.syspath_prepend(str(entry))
        _forget_modules()
        try:
            yield
        finally:
            _forget_modules()


def _forget_modules() -> None:
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None) or ""
        if where.startswith(str(WILD) + os.sep):
            del sys.modules[name]


def measure_real(script: str, argv: list[str], steps: int, by_hand: bool) -> Measured:
    """The real run, counted by ``measure_program`` (``measure_by_hand``), in a process of its own
    (``_forked``): there its counter also counts a sparse tensor, by the storages that hold it (a
    COO tensor's indices and values, a compressed one's index arrays and values), where
    tests/oracles.py's LiveStorages stops ("Cannot access storage of SparseTensorImpl": the GAT
    example builds its adjacency matrix with torch.sparse_coo_tensor)."""
    dense = LiveStorages.add

    def add(self: LiveStorages, t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo:
            for part in (t._indices(), t._values()):
                dense(self, part)
        elif isinstance(t, torch.Tensor) and t.layout in (torch.sparse_csr, torch.sparse_csc,
                                                          torch.sparse_bsr, torch.sparse_bsc):
            compressed, plain = ((t.crow_indices(), t.col_indices()) if t.layout in (torch.sparse_csr, torch.sparse_bsr)
                                 else (t.ccol_indices(), t.row_indices()))
            for part in (compressed, plain, t.values()):
                dense(self, part)
        else:
            dense(self, t)

    LiveStorages.add = add  # type: ignore[method-assign]  # in the forked process alone
    return (measure_by_hand if by_hand else measure_program)(script, argv, steps)


def measure_by_hand(script: str, argv: list[str], steps: int) -> Measured:
    """``measure_program`` for a program with no torch.optim optimizer: step k runs from the end of
    step k-1 to the first module call after the k-th backward pass (the end of the update the
    program makes by hand), where the run is stopped after the last (docs/run.md, "a program with
    no torch.optim optimizer")."""
    import runpy

    counter = LiveStorages()
    counter.phase = "step 1"
    backwards = [0]

    class Stop(BaseException):
        pass

    def on_call(module: Any, args: Any) -> None:
        done = backwards[0]
        if done >= steps:
            raise Stop
        counter.phase = f"step {done + 1}"

    real_backward = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        out = real_backward(*args, **kwargs)
        backwards[0] += 1
        return out

    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    hook = torch.nn.modules.module.register_module_forward_pre_hook(on_call)
    try:
        with mock_attr(torch.autograd, "backward", backward), counter, contextlib.suppress(Stop):
            runpy.run_path(script, run_name="__main__")
    finally:
        hook.remove()
        sys.argv[:], sys.path[:] = saved_argv, saved_path
    return Measured(counter.peak, dict(counter.phase_peaks))


@contextlib.contextmanager
def mock_attr(owner: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _digest(folder: Path) -> dict[str, str]:
    """Every file of the program's repository folder and its hash (Python's own __pycache__ left out)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def _forked(what: str, fn: Callable[[], Any]) -> Any:
    """fn() in a process forked for it, its result pickled back; printed: how long it took.

    Each run has a process of its own: graphmem's recording state does not outlive its run there
    (two programs recorded one after the other in one process can crash it: a segmentation fault
    in graphmem.trace.core.storages.poll, seen with word_language_model's AdamW run then its
    Transformer run), and a program's modules, threads and globals die with its run. An exception
    in the run is raised here as RuntimeError with its type and the first line of its message."""
    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            result: tuple[str, Any] = ("ok", fn())
        except BaseException as error:  # everything goes back to the test
            lines = str(error).strip().splitlines()
            result = ("error", f"{type(error).__name__}: {lines[0] if lines else ''}")
        with os.fdopen(write, "wb") as out:
            out.write(pickle.dumps(result))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as back:
        data = back.read()
    _, status = os.waitpid(pid, 0)
    print(f"{what}: {time.perf_counter() - start:.1f} s")
    if not data:
        raise RuntimeError(f"{what}: its process died ({_how(status)})")
    kind, value = pickle.loads(data)
    if kind == "error":
        raise RuntimeError(value)
    return value


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


# ---------------------------------------------------------------------------------------------
# the tests


def _peaks(script: str, argv: list[str], steps: int) -> tuple[int, list[int]]:
    report = run_program(script, argv, steps=steps).train
    assert report is not None
    return report.peak_bytes, list(report.iteration_peaks)


def _cli(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


def _error(output: str) -> str:
    """graphmem's error and the program's lines under it, else the output's end."""
    at = output.find("\nError: ")
    return output[at + 1:][:2000] if at >= 0 else output[-2000:]


def _params(kind: str) -> list[Any]:
    out = []
    for program in PROGRAMS:
        if kind == "cpu" and program.real_cpu:
            out.append(pytest.param(program.id, marks=program.cpu, id=program.id))
        elif kind == "gpu" and program.gpu_argv is not None:
            out.append(pytest.param(program.id, marks=program.gpu, id=program.id))
        elif kind == "ranks" and program.ranks_env is not None:
            out.append(pytest.param(program.id, marks=program.ranks, id=program.id))
        elif kind == "files":
            out.append(pytest.param(program.id, marks=program.files, id=program.id))
    return out


@pytest.mark.parametrize("name", _params("cpu"))
def test_real_run_equals_graphmem_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peak and each step's peak of graphmem run on the CPU equal the real run's, to the byte."""
    program = BY_ID[name]
    _present(program)
    script = str(WILD / program.script)
    setup = program.setup(tmp_path / "real")
    with _running(program, setup, monkeypatch):
        real = _forked(f"{name} real", lambda: measure_real(script, setup.argv, program.steps, program.by_hand))
    setup = program.setup(tmp_path / "graphmem")
    with _running(program, setup, monkeypatch):
        peak, steps = _forked(f"{name} graphmem", lambda: _peaks(script, setup.argv, program.steps))
    real_steps = [real.phase_peaks.get(f"step {k + 1}") for k in range(program.steps)]
    print(f"{name}: real {real.peak_bytes} {real_steps}; graphmem {peak} {steps}")
    assert peak == real.peak_bytes
    assert steps == real_steps


@pytest.mark.parametrize("name", _params("gpu"))
def test_runs_to_the_end_on_a_gpu(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """graphmem run --gpu h100-80gb --device cuda: the program takes the GPU (its own option for it,
    where it has one) and runs to its last recorded step, exit 0."""
    program = BY_ID[name]
    _present(program)
    setup = program.setup(tmp_path)
    nproc = ["--nproc-per-node", str(program.nproc)] if program.nproc else []
    args = ["run", "--gpu", "h100-80gb", "--device", "cuda", "--steps", str(program.steps), *nproc,
            str(WILD / program.script), *setup.argv, *(program.gpu_argv or ())]
    with _running(program, setup, monkeypatch):
        code, output = _forked(f"{name} gpu", lambda: _cli(args))
    assert code == 0, _error(output)


@pytest.mark.parametrize("name", _params("files"))
def test_graphmem_run_changes_no_file_of_the_program(name: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever graphmem run makes of the program (it may fail: its exit code is not the point),
    every file of the program's repository folder is as it was, byte for byte."""
    program = BY_ID[name]
    _present(program)
    setup = program.setup(tmp_path)
    before = _digest(program.folder)
    target = ["--gpu", "h100-80gb"] if not program.real_cpu else ["--device", "cpu"]
    nproc = ["--nproc-per-node", str(program.nproc)] if program.nproc else []
    with _running(program, setup, monkeypatch):
        _forked(f"{name} files", lambda: _cli(["run", *target, *nproc, "--steps", str(program.steps),
                                                str(WILD / program.script), *setup.argv]))
    assert _digest(program.folder) == before


@pytest.mark.parametrize("name", _params("ranks"))
def test_every_rank_equals_the_real_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On 2 processes as torchrun starts them (the framework's DDP on gloo, chosen through its
    environment): every rank's peak and each step's peak of graphmem run --nproc-per-node 2 equal
    the real run's, counted by tests/dist_oracles.py in 2 spawned gloo processes."""
    from tests.dist_oracles import measure_program_distributed

    program = BY_ID[name]
    _present(program)
    if _LIBRARY is not None:
        pytest.skip("torchvision is installed but its operators do not load with this torch: the spawned ranks "
                    "of the real run, which import it through Lightning, would fail")
    script = str(WILD / program.script)
    setup = program.setup(tmp_path / "real")
    env = {**setup.env, **(program.ranks_env or {})}
    with _running(program, Setup(setup.argv, setup.cwd, env, setup.path), monkeypatch):
        real = _forked(f"{name} real, 2 ranks",
                       lambda: measure_program_distributed(script, setup.argv, world_size=2, steps=program.steps))
    setup = program.setup(tmp_path / "graphmem")
    with _running(program, Setup(setup.argv, setup.cwd, env, setup.path), monkeypatch):
        predicted = _forked(f"{name} graphmem, 2 ranks", lambda: _rank_peaks(script, setup.argv, program.steps))
    measured = {rank: (r["peak_bytes"], [r["phase_peaks"].get(f"step {k + 1}") for k in range(program.steps)])
                for rank, r in enumerate(real)}
    print(f"{name}: real {measured}; graphmem {predicted}")
    assert predicted == measured


def _rank_peaks(script: str, argv: list[str], steps: int) -> dict[int, tuple[int, list[int]]]:
    """graphmem run as the command runs it (its ranks forked from a process that has not imported
    the framework, as each real rank starts afresh: a library's import-time tensors count in both)."""
    done = subprocess.run([sys.executable, "-m", "graphmem", "run", "--nproc-per-node", "2", "--ranks", "all",
                           "--steps", str(steps), "--format", "json", script, *argv],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    ranks = json.loads(done.stdout)["train"]["ranks"]
    return {r["rank"]: (r["peak_bytes"], list(r["step_peak_bytes"])) for r in ranks}
