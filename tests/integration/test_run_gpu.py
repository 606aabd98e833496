"""graphmem run --gpu: the program's "cuda" is the target GPU.  No GPU here, so the checks are
the ones a CPU can make: a program doing analyze's step gives analyze's CUDA numbers (analyze's
CUDA target is checked against published GPU measurements, docs/accuracy-published.md), what stays on
the host weighs nothing on the GPU, and what the program's own torch.cuda calls print is what
the report says at that point of the run."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from graphmem import GraphmemError, analyze, run_program
from graphmem.cli import main
from graphmem.cuda.gpus import get_gpu
from tests.conftest import ROOT
from tests.oracles import save_tiny_gpt2

PROGRAMS = ROOT / "tests" / "programs"


@pytest.mark.parametrize("gpu", ["h100-80gb", "v100-32gb"])
def test_program_doing_analyzes_step_on_the_gpu_gives_analyzes_cuda_numbers(gpu: str) -> None:
    """SGD with momentum (its state all on the GPU): the live peak, each step's peak and the
    caching allocator's peaks equal analyze --gpu's."""
    job = analyze("examples/mlp.py:MLP", ["32x1000"], mode="train", optimizer="sgd",
                  optimizer_kwargs={"momentum": 0.9}, gpu=gpu).train
    run = run_program(str(PROGRAMS / "analyze_step.py"), ["cuda", "sgd"], gpu=gpu).train
    assert job is not None and run is not None and job.allocator and run.allocator
    assert run.peak_bytes == job.peak_bytes and run.iteration_peaks == job.iteration_peaks
    assert run.allocator.allocated_peak_bytes == job.allocator.allocated_peak_bytes
    assert run.allocator.reserved_peak_bytes == job.allocator.reserved_peak_bytes


def test_adams_step_counters_stay_on_the_host() -> None:
    """torch.optim.Adam keeps each parameter's step count in a CPU tensor unless capturable or
    fused (torch/optim/adam.py, _init_group): on the GPU its state is exp_avg and exp_avg_sq."""
    run = run_program(str(PROGRAMS / "analyze_step.py"), ["cuda", "adam"], gpu="h100-80gb").train
    assert run is not None
    state = [s for s in run.trace.storages if s.label.endswith((".step", ".exp_avg", ".exp_avg_sq"))]
    assert {s.label.rsplit(".", 1)[1] for s in state if s.nbytes} == {"exp_avg", "exp_avg_sq"}
    assert all(s.nbytes == 0 for s in state if s.label.endswith(".step"))


def _memory_lines(out: str) -> list[list[int]]:
    return [[int(n) for n in line.split()[1:]] for line in out.splitlines() if line.startswith("memory ")]


def test_torch_cuda_answers_are_the_reports(capfd: pytest.CaptureFixture[str]) -> None:
    """tests/programs/gpu_loop.py prints torch.cuda's counters after each step: after step 1
    they are the caching allocator's peaks of the run stopped after step 1; the GPU is the
    preset's."""
    run_program(str(PROGRAMS / "gpu_loop.py"), ["--steps", "5"], gpu="a100-80gb", steps=2)
    out = capfd.readouterr().out
    first = run_program(str(PROGRAMS / "gpu_loop.py"), ["--steps", "5"], gpu="a100-80gb", steps=1).train
    assert first is not None and first.allocator is not None
    preset = get_gpu("a100-80gb")
    assert f"gpu {preset.product} {preset.total_memory_bytes}" in out
    printed = _memory_lines(out)
    assert len(printed) == 1  # after step 1; the run stops at the end of step 2, before its print
    allocated, max_allocated, reserved, max_reserved = printed[0]
    assert max_allocated == first.allocator.allocated_peak_bytes
    assert max_reserved == first.allocator.reserved_peak_bytes
    assert allocated <= max_allocated and reserved <= max_reserved


def test_what_stays_on_the_host_weighs_nothing_on_the_gpu() -> None:
    """A CPU corpus 64x larger changes the CPU run's peak and not the GPU's; batches moved to
    the GPU, positions made with device=x.device and CPU copies of the loss are placed as a
    real run places them."""
    small, large = (run_program(str(PROGRAMS / "gpu_loop.py"), ["--corpus-rows", str(rows)], gpu="h100-80gb").train
                    for rows in (256, 16384))
    assert small is not None and large is not None
    assert small.peak_bytes == large.peak_bytes
    assert small.allocator and large.allocator
    assert small.allocator.reserved_peak_bytes == large.allocator.reserved_peak_bytes
    positions = [s for s in small.trace.storages if s.shape == (64,) and s.dtype == "int64"]
    assert positions and all(s.nbytes == 64 * 8 for s in positions)  # torch.arange(n, device=x.device)
    assert small.sdpa_backends == {"flash": 2}  # nn.TransformerEncoderLayer's attention, fp16 autocast


def test_multihead_attention_takes_cudas_attention_kernel_in_analyze_too() -> None:
    """nn.MultiheadAttention calls scaled_dot_product_attention from inside a function torch
    hands to graphmem's kernel choice: CUDA's kernel there too (flash for fp16, memory-efficient
    for fp32, as select_sdp_backend picks on sm90), never the math path's s x s matrix."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)

        def forward(self, x: object) -> object:
            return self.block(x)

    for amp, backend in (("fp16", "flash"), (None, "efficient")):
        report = analyze(Block, ["8x64x256"], mode="train", optimizer="adam", gpu="h100-80gb", amp=amp).train
        assert report is not None and set(report.sdpa_backends) == {backend}
        assert not any("_safe_softmax" in op.op for op in report.trace.ops)


def test_command_line_on_the_gpu() -> None:
    result = CliRunner().invoke(main, ["run", "--gpu", "h100-80gb", "examples/train_loop.py", "--batch-size", "8"])
    assert result.exit_code == 0, result.output
    assert re.search(r"device\s+cuda, h100-80gb", result.output)
    assert "reserved peak (max_memory_reserved)" in result.output
    assert re.search(r"allocator\s+PyTorch's defaults", result.output)
    conf = CliRunner().invoke(main, ["run", "--gpu", "h100-80gb", "--alloc-conf", "expandable_segments:True",
                                     "--format", "json", "examples/train_loop.py", "--batch-size", "8"])
    assert conf.exit_code == 0, conf.output
    data, _ = json.JSONDecoder().raw_decode(conf.stdout[conf.stdout.index("{"):])  # the program prints after it
    assert data["setup"]["alloc_conf"] == "expandable_segments:True"  # the settings it ran under
    both = CliRunner().invoke(main, ["run", "--device", "cpu", "--gpu", "h100-80gb", "examples/train_loop.py"])
    assert both.exit_code == 2 and "give one of them" in both.output


def test_hf_trainer_on_the_gpu(tmp_path: object) -> None:
    """transformers' Trainer asks torch.cuda and torch.accelerator which device there is and
    moves the model itself (accelerate prepares it again): on the GPU its tied GPT-2 weights are
    one storage, and the parameters and fused AdamW's state are the CPU run's, now on the GPU."""
    pytest.importorskip("transformers")
    script = str(PROGRAMS / "hf_trainer.py")
    cpu = run_program(script, [str(tmp_path)]).train
    gpu = run_program(script, [str(tmp_path), "--cuda"], gpu="h100-80gb").train
    assert cpu is not None and gpu is not None and gpu.allocator is not None
    assert gpu.params_bytes == cpu.params_bytes > 0
    assert gpu.optimizer_state_bytes == cpu.optimizer_state_bytes > 0
    assert gpu.sdpa_backends  # GPT-2's attention took a CUDA kernel


def test_from_pretrained_reads_headers_only(tmp_path: object) -> None:
    """A checkpoint cut after its safetensors header (no weights at all) gives the same run as
    the whole one: nothing but the header was read.  The parameters on the GPU are the model's
    distinct parameter bytes (its tied embedding once), as torch counts them."""
    import struct
    from pathlib import Path

    pytest.importorskip("transformers")
    full, params = save_tiny_gpt2(Path(str(tmp_path)) / "full")
    cut = Path(str(tmp_path)) / "cut"
    cut.mkdir()
    for f in Path(str(full)).iterdir():
        data = f.read_bytes()
        if f.suffix == ".safetensors":
            data = data[:8 + struct.unpack("<Q", data[:8])[0]]
        (cut / f.name).write_bytes(data)
    script = str(PROGRAMS / "from_pretrained.py")
    whole, header = (run_program(script, [str(folder)], gpu="h100-80gb").train for folder in (full, cut))
    assert whole is not None and header is not None and whole.allocator and header.allocator
    assert header.peak_bytes == whole.peak_bytes and header.iteration_peaks == whole.iteration_peaks
    assert header.allocator.reserved_peak_bytes == whole.allocator.reserved_peak_bytes
    assert whole.params_bytes == params


def test_lightning_on_the_gpu() -> None:
    """Lightning takes the GPU it is told of (accelerator="auto") and steps the optimizer with a
    closure that runs the forward and backward inside the step: the update after the closure is
    the optimizer phase, in the foreach implementation PyTorch picks for CUDA parameters."""
    pytest.importorskip("lightning")
    result = CliRunner().invoke(main, ["run", "--gpu", "h100-80gb", str(PROGRAMS / "lightning_fit.py"), "auto"])
    assert result.exit_code == 0, result.output
    assert "Adam (foreach)" in result.output and re.search(r"device\s+cuda, h100-80gb", result.output)


def test_nanogpt_style_script_on_the_gpu(tmp_path: object) -> None:
    """The same script on the GPU: bf16 autocast held in one object entered again and again
    (``ctx = torch.amp.autocast(...)``), fused AdamW, pinned batches moved non-blocking; the
    memmapped corpus stays on the host."""
    report = run_program(str(PROGRAMS / "nanogpt_style.py"), ["--out", str(tmp_path)], gpu="h100-80gb").train
    assert report is not None and report.allocator is not None
    # bf16, causal, head dim 32: flash; 2 blocks x 6 forwards (2 evaluation batches, 2 steps x 2 micro-batches)
    assert report.sdpa_backends == {"flash": 12}
    made = {s.sid: report.trace.ops[s.created].op for s in report.trace.storages if s.created >= 0}
    stacked = [s for s in report.trace.storages if made.get(s.sid) == "aten.stack.default" and s.shape == (8, 64)]
    moved = [s for s in report.trace.storages if made.get(s.sid) == "aten._to_copy.default" and s.shape == (8, 64)]
    assert stacked and all(s.nbytes == 0 for s in stacked)  # each batch stacked on the host...
    assert moved and all(s.nbytes == 8 * 64 * 8 for s in moved)  # ...and its copy on the GPU


def test_torch_cuda_api_of_gpu_programs(capfd: pytest.CaptureFixture[str]) -> None:
    """Seeds, capability, device contexts, NVTX, streams, events, memory_summary, the generator's
    state and activation checkpointing (it saves and restores the CUDA generator) all run; before
    the first tensor the whole GPU is free."""
    report = run_program(str(PROGRAMS / "cuda_apis.py"), gpu="a100-80gb").train
    out = capfd.readouterr().out
    preset = get_gpu("a100-80gb")
    assert report is not None and report.peak_bytes > 0
    memory = preset.total_memory_bytes
    assert "capability (8, 0) True" in out and f"free {memory} total {memory}" in out
    assert any(op.recompute for op in report.trace.ops)  # the checkpointed forward ran again in backward


@pytest.mark.parametrize(("asked", "taken"), [("", "flash"), ("efficient", "efficient"), ("math", "math")])
def test_the_programs_sdpa_kernel_choice_is_honoured(asked: str, taken: str) -> None:
    """torch.nn.attention.sdpa_kernel(...) narrows the backends as select_sdp_backend sees them."""
    report = run_program(str(PROGRAMS / "sdpa_choice.py"), [asked] if asked else [], gpu="h100-80gb").train
    assert report is not None and set(report.sdpa_backends) == {taken}


def test_the_programs_dispatch_modes_see_the_gpus_devices(capfd: pytest.CaptureFixture[str]) -> None:
    """A selective checkpointing policy that saves each copy from the GPU to the host (as
    torchtitan's does) sees the one real ``.cpu()`` per block, not the norm's ``type_as`` cast,
    whose device argument torch's C++ code takes from the tensor: on a GPU that is the GPU.  So
    the rule saves nothing more: the run equals the one without it."""
    runs = [run_program(str(PROGRAMS / "sac_policy.py"), flags, gpu="h100-80gb").train
            for flags in ([], ["--no-host-rule"])]
    assert re.findall(r"host copies seen (\d+)", capfd.readouterr().out) == ["4", "4"]  # 4 blocks, after step 1
    with_rule, without = runs
    assert with_rule is not None and without is not None and with_rule.allocator and without.allocator
    assert with_rule.peak_bytes == without.peak_bytes
    assert with_rule.allocator.reserved_peak_bytes == without.allocator.reserved_peak_bytes


def test_fsdp_over_tensor_parallel_initialises_its_dtensors_on_the_gpu() -> None:
    """trunc_normal_ on parameters that FSDP2 shards over tensor parallelism (a _StridedShard
    placement) on a GPU mesh: DTensor's RNG tracker asks which rows this rank holds, worked out
    from real indices (a fake holds none).  Each rank holds a quarter of the parameters, but the
    row-wise layer's bias (replicated over tensor parallelism) a half: 525,824 B, as a real
    4-process gloo run of the same program on a CPU mesh holds on every rank."""
    run = run_program(str(PROGRAMS / "fsdp_tp_init.py"), gpu="h100-80gb", nproc_per_node=4, ranks=[0]).train
    assert run is not None
    assert run.params_bytes == (256 * 1024 + 1024 + 1024 * 256) * 4 // 4 + 256 * 4 // 2  # float32


def test_cuda_graph_names_are_types_and_refused_when_used() -> None:
    """torch.cuda.CUDAGraph may stand in an annotation evaluated at import (``CUDAGraph | None``);
    making one is refused with what to do instead."""
    report = run_program(str(PROGRAMS / "cuda_graph_names.py"), gpu="h100-80gb").train
    assert report is not None and report.peak_bytes > 0
    with pytest.raises(GraphmemError, match="captures a CUDA graph"):
        run_program(str(PROGRAMS / "cuda_graph_names.py"), ["--capture"], gpu="h100-80gb")


def test_cuda_autocast_to_float32_runs_as_float32(tmp_path: object) -> None:
    """torch.amp.autocast("cuda", dtype=torch.float32) (nanoGPT's dtype='float32' on a GPU): the
    ops it would cast run in float32, as with no autocast: the same peaks as the program without it."""
    from pathlib import Path

    folder = Path(str(tmp_path))
    body = """
import contextlib, sys, torch
from torch import nn
model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
opt = torch.optim.AdamW(model.parameters())
ctx = torch.amp.autocast("cuda", dtype=torch.float32) if sys.argv[1] == "fp32" else contextlib.nullcontext()
for _ in range(2):
    with ctx:
        loss = model(torch.randn(8, 64, device="cuda")).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""
    (folder / "prog.py").write_text(body)
    with_fp32 = run_program(str(folder / "prog.py"), ["fp32"], gpu="h100-80gb").train
    without = run_program(str(folder / "prog.py"), ["none"], gpu="h100-80gb").train
    assert with_fp32 is not None and without is not None
    assert with_fp32.iteration_peaks == without.iteration_peaks and with_fp32.peak_bytes == without.peak_bytes


def test_data_parallel_on_the_one_gpu(tmp_path: object) -> None:
    """nn.DataParallel(model).cuda() (pytorch/examples' imagenet) in a process with one GPU: its
    scatter moves the CPU batch to the GPU and the model runs there, as calling the model on
    the moved batch does: the same peaks."""
    from pathlib import Path

    folder = Path(str(tmp_path))
    (folder / "prog.py").write_text("""
import sys, torch
from torch import nn
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
wrapped = nn.DataParallel(model).cuda() if sys.argv[1] == "dp" else model.cuda()
opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
for _ in range(2):
    x = torch.randn(8, 64)
    out = wrapped(x) if sys.argv[1] == "dp" else wrapped(x.cuda())
    out.sum().backward()
    opt.step()
    opt.zero_grad()
""")
    data_parallel = run_program(str(folder / "prog.py"), ["dp"], gpu="h100-80gb").train
    plain = run_program(str(folder / "prog.py"), ["plain"], gpu="h100-80gb").train
    assert data_parallel is not None and plain is not None
    assert data_parallel.iteration_peaks == plain.iteration_peaks
