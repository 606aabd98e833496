"""graphmem run of real training frameworks, against the same command run for real on the CPU.

torchtune 0.6.1's single-device recipes (full fine-tuning and LoRA, site-packages/recipes/*.py
with tests/programs/tune's configs), run as ``python RECIPE --config ...``: tests/oracles.py's
measure_program in a process of its own against ``graphmem run`` in another; the peak and each
step's peak to the byte.  On the fake GPU (device=cuda dtype=bf16) both recipes run.

torchtitan 0.3.0's trainer (tests/programs/titan/train.py, the configs in its tiny_titan
package), launched as torchrun launches it: tests/dist_oracles.py's program oracle runs it for
real in N gloo processes and counts each rank's live storages op by op from its first line to
the end of its 2nd optimizer step; ``graphmem run`` is run as a user runs it, a command in a
process of its own (a library's import-time tensors count in both).  Every rank's peak and
each step's peak, to the byte.  On graphmem's fake GPU, torchtitan's own debugmodel config
(FlexAttention, selective activation checkpointing, bf16 FSDP parameters) over 8 ranks runs.

Slow (each real run starts 1 or 4 Python processes that import the framework); skipped where
torchtitan or torchtune is not installed: ``pip install 'graphmem[frameworks]'``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.dist_oracles import measure_program_distributed

pytestmark = pytest.mark.slow

TITAN = ROOT / "tests" / "programs" / "titan"
TUNE = ROOT / "tests" / "programs" / "tune"
TRAIN = str(TITAN / "train.py")
TINY = ["--module", "tiny_titan", "--config", "llama3_cpu_tiny"]
FSDP4 = ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.spmd_backend", "partial_dtensor"]


@pytest.fixture
def titan_assets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """torchtitan installed, and tests/programs/titan/make_assets.py's tokenizer and data in
    tmp_path, named by TINY_TITAN_ASSETS (the configs read it; every process inherits it)."""
    pytest.importorskip("torchtitan")
    pytest.importorskip("tokenizers")
    sys.path.insert(0, str(TITAN))
    try:
        from make_assets import write_assets
    finally:
        sys.path.remove(str(TITAN))
    write_assets(tmp_path)
    for name, value in {"TINY_TITAN_ASSETS": str(tmp_path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                        "HF_DATASETS_CACHE": str(tmp_path / "datasets")}.items():
        monkeypatch.setenv(name, value)
    return tmp_path


@pytest.fixture
def tune_assets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """torchtune installed, and tests/programs/tune/make_assets.py's tokenizer, checkpoint and
    data in tmp_path, named by TINY_TUNE_ASSETS (the configs read it)."""
    pytest.importorskip("torchtune")
    pytest.importorskip("sentencepiece")
    for name, value in {"TINY_TUNE_ASSETS": str(tmp_path), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                        "HF_DATASETS_CACHE": str(tmp_path / "datasets")}.items():
        monkeypatch.setenv(name, value)
    made = subprocess.run([sys.executable, str(TUNE / "make_assets.py"), str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    return tmp_path


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _graphmem_run(*args: str) -> dict[str, Any]:
    """``graphmem run --format json ARGS`` as a command, in a process of its own."""
    done = subprocess.run([sys.executable, "-m", "graphmem", "run", "--format", "json", *args],
                          capture_output=True, text=True, env=_env(), timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    start = done.stdout.index("{\n")  # the program prints its own log lines first
    data: dict[str, Any] = json.loads(done.stdout[start:])
    return data


def test_torchtitan_one_process(titan_assets: Path) -> None:
    """torchrun --nproc-per-node 1: FSDP2 on a 1-rank mesh, a meta-device model moved with
    to_empty (its DTensor parameters swapped), AdamW inside torchtitan's optimizer container."""
    real = measure_program_distributed(TRAIN, TINY, world_size=1, steps=2)[0]
    train = _graphmem_run("--nproc-per-node", "1", TRAIN, *TINY)["train"]
    assert train["peak_bytes"] == real["peak_bytes"]
    assert [train["first_step_peak_bytes"], train["steady_state_peak_bytes"]] == \
        [real["phase_peaks"]["step 1"], real["phase_peaks"]["step 2"]]


def test_torchtitan_fsdp_four_ranks(titan_assets: Path) -> None:
    """torchrun --nproc-per-node 4, FSDP2 over 4 ranks (--parallelism.spmd_backend
    partial_dtensor: torchtitan 0.3.0's default needs a newer torch's fully_shard): every rank."""
    real = measure_program_distributed(TRAIN, [*TINY, *FSDP4], world_size=4, steps=2)
    ranks = _graphmem_run("--nproc-per-node", "4", "--ranks", "all", TRAIN, *TINY, *FSDP4)["train"]["ranks"]
    predicted = {r["rank"]: r for r in ranks}
    assert sorted(predicted) == [0, 1, 2, 3]
    for rank, measured in enumerate(real):
        assert predicted[rank]["peak_bytes"] == measured["peak_bytes"], rank
        assert predicted[rank]["step_peak_bytes"] == [measured["phase_peaks"][f"step {k}"] for k in (1, 2)], rank


_PP = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.spmd_backend", "partial_dtensor"]


def _schedules_take_micro_batches() -> bool:
    """Whether this torch's pipeline schedules take ``step(arg_mbs=...)`` (torch 2.14's do), read
    from their source: importing torch.distributed.pipelining here, while tests are collected,
    would make its import-time tensor in pytest's process, which the pipelined programs of
    other tests then would not make (their real runs, in processes of their own, would)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    import ast

    source = Path(spec.origin).parent / "distributed" / "pipelining" / "schedules.py"
    if not source.exists():
        return False
    classes = {node.name: node for node in ast.parse(source.read_text()).body if isinstance(node, ast.ClassDef)}
    steps = [item for name in ("PipelineScheduleSingle", "PipelineScheduleMulti") if name in classes
             for item in classes[name].body if isinstance(item, ast.FunctionDef) and item.name == "step"]
    return len(steps) == 2 and all("arg_mbs" in [a.arg for a in (*s.args.args, *s.args.kwonlyargs)] for s in steps)


@pytest.mark.skipif(not _schedules_take_micro_batches(),
                    reason="torchtitan 0.3.0's pipeline schedules call step(arg_mbs=...), which this torch's do not "
                           "take (torch 2.14's do: pip install torch==2.14.1)")
@pytest.mark.parametrize("world, extra", [
    (2, []),
    (2, ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    (4, ["--parallelism.data_parallel_shard_degree", "2"]),
], ids=["1f1b-2-stages", "interleaved-1f1b", "2-stages-x-fsdp-2"])
def test_torchtitan_pipeline_parallel(titan_assets: Path, world: int, extra: list[str]) -> None:
    """torchtitan's own pipeline parallelism (its stages built from the model's layers, its
    schedule's step with micro-batches, shapes told at run time), alone and with FSDP2 over
    the other mesh dimension: every rank, each step, equal to the real gloo run."""
    argv = [*TINY, *_PP, *extra]
    real = measure_program_distributed(TRAIN, argv, world_size=world, steps=2)
    ranks = _graphmem_run("--nproc-per-node", str(world), "--ranks", "all", TRAIN, *argv)["train"]["ranks"]
    predicted = {r["rank"]: r for r in ranks}
    assert sorted(predicted) == list(range(world))
    for rank, measured in enumerate(real):
        assert predicted[rank]["peak_bytes"] == measured["peak_bytes"], rank
        assert predicted[rank]["step_peak_bytes"] == [measured["phase_peaks"][f"step {k}"] for k in (1, 2)], rank


def test_torchtitan_own_config_on_eight_gpus(titan_assets: Path) -> None:
    """torchtitan's debugmodel as it is (FlexAttention, selective activation checkpointing, bf16
    FSDP parameters, seq 2048 x 8) on 8 fake H100s: it runs, FlexAttention as one kernel each way
    (no score matrix), the unsharded parameters FSDP regrows for the backward on the GPU.  Its
    CUDA graphs (0.3.0's default) are refused with what to pass instead."""
    config = [TRAIN, "--module", "tiny_titan", "--config", "llama3_debug_local",
              "--parallelism.spmd_backend", "partial_dtensor"]
    refused = subprocess.run([sys.executable, "-m", "graphmem", "run", "--gpu", "h100-80gb", "--nproc-per-node", "8",
                              "--ranks", "0", *config], capture_output=True, text=True, env=_env(), timeout=600)
    assert refused.returncode == 3
    assert "captures a CUDA graph" in refused.stderr and "--training.disable_cuda_graphs" in refused.stderr
    train = _graphmem_run("--gpu", "h100-80gb", "--nproc-per-node", "8", *config,
                          "--training.disable_cuda_graphs")["train"]
    assert {r["rank"] for r in train["ranks"]} == {0, 7}
    parameters = 6_163_712 * 4 // 8  # the sharded float32 parameters of a rank
    for rank in train["ranks"]:
        assert rank["breakdown"]["parameters"] + rank["breakdown"]["communication"] >= parameters
        assert rank["allocated_peak_bytes"] >= rank["peak_bytes"] > 0


def _recipe(name: str) -> str:
    """torchtune's recipe script (installed next to the package, in site-packages/recipes)."""
    import torchtune

    return str(Path(torchtune.__file__).resolve().parents[1] / "recipes" / f"{name}.py")


_MEASURE = ("import json, sys; from tests.oracles import measure_program; "
            "m = measure_program(sys.argv[1], sys.argv[2:], 2); "
            "print(json.dumps(m.phase_peaks | {'peak': m.peak_bytes}))")  # the real run, in a process of its own


@pytest.mark.parametrize("recipe, config", [("full_finetune_single_device", "tiny_full.yaml"),
                                            ("lora_finetune_single_device", "tiny_lora.yaml")], ids=["full", "lora"])
def test_torchtune_single_device(tune_assets: Path, recipe: str, config: str) -> None:
    """The recipe as ``python RECIPE --config CONFIG`` runs it: its checkpoint read with
    torch.load (mmap), alpaca batches padded to their longest sequence, the chunked cross
    entropy, AdamW (LoRA: on the adapters only)."""
    argv = [_recipe(recipe), "--config", str(TUNE / config)]
    done = subprocess.run([sys.executable, "-c", _MEASURE, *argv], capture_output=True, text=True, env=_env(),
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    real = json.loads(done.stdout.strip().splitlines()[-1])
    train = _graphmem_run(*argv)["train"]
    assert train["peak_bytes"] == real["peak"]
    assert [train["first_step_peak_bytes"], train["steady_state_peak_bytes"]] == [real["step 1"], real["step 2"]]
    gpu = _graphmem_run("--gpu", "h100-80gb", *argv, "device=cuda", "dtype=bf16")["train"]
    assert 0 < gpu["peak_bytes"] < train["peak_bytes"]  # bf16 on the GPU: less than float32 on the CPU
