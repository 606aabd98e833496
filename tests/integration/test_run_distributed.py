"""graphmem run --nproc-per-node: each rank of a torchrun-style program against the same program
run for real in that many gloo processes on the CPU (tests/dist_oracles.py's
measure_program_distributed: live storages counted from each rank's first line to the end of its
K-th optimizer step): every rank's peak and each step's peak, to the byte."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from graphmem import run_program
from graphmem.cli import main
from tests.conftest import ROOT
from tests.dist_oracles import measure_program_distributed
from tests.optional import extended

PROGRAMS = ROOT / "tests" / "programs"


@pytest.mark.parametrize("program", ["ddp.py", "fsdp.py", "fsdp_meta.py", "tp.py", "zero.py", "objects.py"])
def test_every_rank_equals_the_real_run(program: str) -> None:
    """DistributedDataParallel (1 MB buckets), FSDP2 (fully_shard per block, a device mesh made
    by the program), FSDP2 as torchtitan builds it (on the meta device, then to_empty on
    ``cpu:LOCAL_RANK`` and trunc_normal_ on the DTensor parameters; a container optimizer; a
    tensor made at import, held by each rank's own process), tensor parallelism
    (parallelize_module, column- then row-wise) and ZeRO-1 (DDP with ZeroRedundancyOptimizer:
    the ranks' shares of Adam's state differ), Python objects broadcast and gathered between
    the ranks (each rank keeps its own: the others are not recorded with it), each with the
    program's own init_process_group("gloo")."""
    script = str(PROGRAMS / program)
    real = measure_program_distributed(script, world_size=2, steps=2)
    report = run_program(script, nproc_per_node=2, ranks="all").train
    assert report is not None
    predicted = {r.rank: r.report for r in report.ranks}
    assert sorted(predicted) == [0, 1]
    for rank, measured in enumerate(real):
        assert predicted[rank].peak_bytes == measured["peak_bytes"], rank
        assert list(predicted[rank].iteration_peaks) == [measured["phase_peaks"][f"step {k}"] for k in (1, 2)]


@pytest.mark.parametrize("env", [
    {"STRATEGY": "SHARD_GRAD_OP", "MIXED": "1"},
    pytest.param({}, marks=extended("SHARD_GRAD_OP with bfloat16 parameters runs by default")),
    pytest.param({"ORIG_PARAMS": "0"}, marks=extended("SHARD_GRAD_OP with bfloat16 parameters runs by default")),
    pytest.param({"STRATEGY": "NO_SHARD"}, marks=extended("SHARD_GRAD_OP with bfloat16 parameters runs by default")),
], ids=["shard-grad-op-bf16", "full-shard", "flat-parameters-to-the-optimizer", "no-shard"])
def test_the_first_fsdp_every_rank_equals_the_real_run(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """FullyShardedDataParallel (FSDP1: flat parameters, auto-wrapped blocks): it frees and
    regrows its unsharded flat parameters by resizing their storages and checks storages by
    data pointer, which fake tensors lack; its bfloat16 output against float32 targets gives a
    float32 MSE loss. Each rank equal to the real 2-process gloo run, to the byte, each step."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    script = str(PROGRAMS / "fsdp1.py")
    real = measure_program_distributed(script, world_size=2, steps=2)
    report = run_program(script, nproc_per_node=2, ranks="all").train
    assert report is not None
    predicted = {r.rank: r.report for r in report.ranks}
    for rank, measured in enumerate(real):
        assert predicted[rank].peak_bytes == measured["peak_bytes"], rank
        assert list(predicted[rank].iteration_peaks) == [measured["phase_peaks"][f"step {k}"] for k in (1, 2)]


def test_accelerate_launched_loop_on_two_processes() -> None:
    """An accelerate loop (Accelerator.prepare, accelerator.backward) launched on 2 processes:
    accelerate wraps the model in DDP from torchrun's environment and moves each batch to
    "cpu:0"; each rank equal to the real 2-process run."""
    pytest.importorskip("accelerate")  # imported before both: its import-time tensors count in neither
    script = str(PROGRAMS / "accelerate_loop.py")
    real = measure_program_distributed(script, world_size=2, steps=2)
    report = run_program(script, nproc_per_node=2, ranks="all").train
    assert report is not None
    assert {r.rank: r.report.peak_bytes for r in report.ranks} == {k: r["peak_bytes"] for k, r in enumerate(real)}


def test_one_process_as_torchrun_starts_it() -> None:
    """--nproc-per-node 1: the program sees torchrun's environment and its init_process_group
    joins a group of one, as torchrun --nproc-per-node 1 runs it (without the option it runs as
    python runs it, and a torchrun program fails as it would: no RANK)."""
    script = str(PROGRAMS / "ddp.py")
    real = measure_program_distributed(script, world_size=1, steps=2)[0]
    report = run_program(script, nproc_per_node=1).train
    assert report is not None and not report.ranks
    assert report.peak_bytes == real["peak_bytes"]
    assert list(report.iteration_peaks) == [real["phase_peaks"][f"step {k}"] for k in (1, 2)]
    result = CliRunner().invoke(main, ["run", "--nproc-per-node", "1", script])
    assert result.exit_code == 0 and "torchrun --nproc-per-node 1" in result.output, result.output


def test_ranks_on_the_command_line() -> None:
    script = str(PROGRAMS / "ddp.py")
    result = CliRunner().invoke(main, ["run", "--nproc-per-node", "2", script])
    assert result.exit_code == 0, result.output
    assert "torchrun --nproc-per-node 2" in result.output and "ranks 0, 1 of 2 recorded" in result.output
    outside = CliRunner().invoke(main, ["run", "--nproc-per-node", "2", "--ranks", "5", script])
    assert outside.exit_code == 2 and "the ranks are 0 to 1" in outside.output


def test_nodes_give_each_rank_torchruns_environment() -> None:
    """--nnodes 2 --nproc-per-node 2: global ranks 0-3, LOCAL_RANK and GROUP_RANK per node, one
    process group of 4 (the program prints what it sees)."""
    import subprocess

    script = str(PROGRAMS / "ddp.py")  # the ranks run side by side in worker processes: a whole command
    done = subprocess.run([sys.executable, "-m", "graphmem", "run", "--nnodes", "2", "--nproc-per-node", "2",
                           "--ranks", "all", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for rank in range(4):  # the program's own prints: on stderr, graphmem's report alone on stdout
        assert f"rank {rank} local {rank % 2} node {rank // 2} world 4" in done.stderr
    assert "torchrun --nnodes 2 --nproc-per-node 2" in done.stdout


def test_nccl_buffers_on_the_gpu_as_analyze_counts_them() -> None:
    """A DDP program on the GPU holds one communicator (its one process group of 2 ranks): NCCL's
    buffers as analyze --parallel ddp=2 --gpu counts them for its one group; none in one process."""
    from graphmem import analyze

    script = str(PROGRAMS / "ddp.py")
    ranks = run_program(script, nproc_per_node=2, gpu="h100-80gb").train
    job = analyze("examples/mlp.py:MLP", ["32x1000"], mode="train", optimizer="adam", gpu="h100-80gb",
                  parallel="ddp=2").train
    single = run_program(str(PROGRAMS / "analyze_step.py"), ["cuda"], gpu="h100-80gb").train
    assert ranks is not None and ranks.allocator and job is not None and job.allocator
    assert single is not None and single.allocator
    assert ranks.allocator.nccl_buffer_bytes == job.allocator.nccl_buffer_bytes > 0
    assert single.allocator.nccl_buffer_bytes == 0


@pytest.mark.slow
@pytest.mark.parametrize(("program", "world", "env", "recorded"), [
    ("pipelined.py", 4, {"SCHEDULE": "gpipe"}, [0, 2, 3]),
    pytest.param("pipelined.py", 3, {"SCHEDULE": "1f1b", "PP": "3"}, [0, 1, 2],
                 marks=extended("GPipe on 2 x 2 and the interleaved schedule run by default")),
    ("pipelined_interleaved.py", 2, {}, [0, 1]),
], ids=["gpipe-2-stages-x-2-replicas", "1f1b-3-stages", "interleaved-2-stages-per-rank"])
def test_pipelined_programs_every_recorded_rank_equals_the_real_run(
        program: str, world: int, env: dict[str, str], recorded: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.distributed.pipelining with no example shapes given: the stages tell each other
    their shapes at run time, which graphmem carries between the ranks it records each alone.
    ``--ranks auto`` records rank 0, the last, and each stage's first rank (rank 2 on the 2 x 2
    mesh of stages by replicas); each equal to the real gloo run, to the byte, each step."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    script = str(PROGRAMS / program)
    real = measure_program_distributed(script, world_size=world, steps=2)
    report = run_program(script, nproc_per_node=world).train
    assert report is not None
    predicted = {r.rank: r.report for r in report.ranks}
    assert sorted(predicted) == recorded
    for rank in recorded:
        assert predicted[rank].peak_bytes == real[rank]["peak_bytes"], rank
        assert list(predicted[rank].iteration_peaks) == [real[rank]["phase_peaks"][f"step {k}"] for k in (1, 2)]
