"""graphmem run --gpu h100-80gb --nproc-per-node 2 on PyTorch's own tutorials (tests/programs/
ddp_tutorial.py, fsdp2_tutorial.py): each rank sees the node's GPUs as torchrun's processes
would, one of them its own, through whichever API it asks (torch.cuda, torch.accelerator, an int
device, FSDP2's default mesh).  The oracle: what a rank holds of parameters, gradients and
optimizer state is the device's own bytes, so each rank on the GPU holds what the same rank of
the same program holds on the CPU target (with gloo), and both are the hand count below."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from graphmem import GraphmemError, run_program
from graphmem.memory.results import ModeReport
from tests.conftest import ROOT

PROGRAMS = ROOT / "tests" / "programs"


def _ranks(script: str, argv: list[str], gpu: str | None) -> dict[int, ModeReport]:
    report = run_program(str(PROGRAMS / script), argv, gpu=gpu, nproc_per_node=2, ranks="all").train
    assert report is not None
    return {r.rank: r.report for r in report.ranks}


def _held(report: ModeReport) -> tuple[int, int, int]:
    return report.params_bytes, report.grads_bytes, report.optimizer_state_bytes


@pytest.fixture(scope="module")
def ddp_on_the_cpu() -> dict[int, ModeReport]:
    return _ranks("ddp_tutorial.py", ["--cpu"], None)


@pytest.mark.parametrize("setup", [[], ["--accelerator"]], ids=["torch.cuda", "torch.accelerator"])
def test_ddp_tutorial_each_rank_holds_what_it_holds_on_the_cpu(setup: list[str],
                                                               ddp_on_the_cpu: dict[int, ModeReport]) -> None:
    """torch.cuda.set_device(LOCAL_RANK) (or torch.accelerator.set_device_index), model.to(an int),
    DDP(device_ids=[an int]), batches .to(an int): both ranks run.  nn.Linear(20, 1) in float32:
    (20 + 1) x 4 = 84 B of parameters and of gradients on every rank (DDP replicates); plain SGD
    keeps no state."""
    on_the_gpu = _ranks("ddp_tutorial.py", setup, "h100-80gb")
    assert sorted(on_the_gpu) == sorted(ddp_on_the_cpu) == [0, 1]
    for rank, report in on_the_gpu.items():
        assert _held(report) == _held(ddp_on_the_cpu[rank]) == (84, 84, 0), rank
        assert report.allocator is not None  # on the GPU: the caching allocator's numbers too


def test_fsdp2_tutorial_shards_on_the_gpu_mesh_by_default() -> None:
    """fully_shard(layer) per block, then fully_shard(model), no mesh given: FSDP2's default mesh
    is the accelerator's, so each rank holds half of every parameter on its GPU.  The model:
    embeddings 1024 x 16 + 64 x 16, per block two LayerNorms (2 x 32), wq/wk/wv/wo (4 x 256),
    w1 (16 x 64 + 64), w2 (64 x 16 + 16) = 3216, four blocks, a LayerNorm (32), the output
    16 x 1024: 46,688 float32 parameters, 186,752 B, 93,376 B per rank (dims divide by 2: no
    padding); gradients alike; Adam's exp_avg and exp_avg_sq twice that.  Adam's step counters
    (one float32 each, 53 parameters) are the host's on a GPU, as PyTorch keeps them there
    (non-capturable, non-fused), and the CPU target's own memory on the CPU: 212 B apart."""
    on_the_gpu = _ranks("fsdp2_tutorial.py", [], "h100-80gb")
    on_the_cpu = _ranks("fsdp2_tutorial.py", ["--cpu"], None)
    assert sorted(on_the_gpu) == sorted(on_the_cpu) == [0, 1]
    per_rank = 46_688 * 4 // 2
    for rank, report in on_the_gpu.items():
        cpu = on_the_cpu[rank]
        assert report.params_bytes == cpu.params_bytes == per_rank, rank
        assert report.grads_bytes == cpu.grads_bytes == per_rank, rank
        assert report.optimizer_state_bytes == 2 * per_rank == cpu.optimizer_state_bytes - 53 * 4, rank


DEVICES = """
import os
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("nccl")
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
model = nn.Linear(4, 4).to(local)
x = torch.randn(2, 4).to(local)
with torch.device("cuda"):
    default = torch.get_default_device()
print(f"rank {local}: count {torch.cuda.device_count()} {torch.accelerator.device_count()} "
      f"current {torch.cuda.current_device()} {torch.accelerator.current_device_index()} "
      f"module {torch.get_device_module().__name__} device {torch.device(local)} "
      f"x {x.device} {x.get_device()} param {model.weight.device} default {default}")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(x).sum().backward()
    opt.step()
"""


def test_each_rank_sees_its_own_gpu(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The node's two GPUs, the one the rank selected current, its tensors on it, torch's default
    device module the GPU's, torch.device(an int) the GPU's index."""
    script = tmp_path / "devices.py"
    script.write_text(DEVICES)
    run_program(str(script), gpu="h100-80gb", nproc_per_node=2, ranks="all")
    out = capfd.readouterr().out
    for rank in (0, 1):
        assert (f"rank {rank}: count 2 2 current {rank} {rank} module torch.cuda device cuda:{rank} "
                f"x cuda:{rank} {rank} param cuda:{rank} default cuda:{rank}") in out, out


RAISES_IN_TORCH = """
import os
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
model = DDP(nn.Linear(4, 4).to(local), device_ids=[0, 1])
"""


def test_an_error_raised_inside_torch_names_torchs_line(tmp_path: Path) -> None:
    """DDP refuses two device ids for one process, in torch's Python code: the message names the
    cause and torch's line that raised it, as it names a library's."""
    script = tmp_path / "raises.py"
    script.write_text(textwrap.dedent(RAISES_IN_TORCH))
    with pytest.raises(GraphmemError) as raised:
        run_program(str(script), gpu="h100-80gb", nproc_per_node=2, ranks=[0])
    message = str(raised.value)
    assert "device_ids can only be None or contain a single element" in message
    assert "torch/nn/parallel/distributed.py:" in message
