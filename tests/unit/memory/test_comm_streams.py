"""--parallel on the CUDA target: the streams allocations are made on, and NCCL's own buffers.

Where a real run allocates on which stream (torch 2.13): FSDP2's all-gather output under its
all-gather copy-in stream (_fsdp_collectives.py ``foreach_all_gather``), its reduce-scatter
output under its reduce-scatter stream and its reduce-scatter input on the default stream
(``foreach_reduce``); DDP's buckets and everything else on the default stream.  The caching
allocator never hands a block freed on one stream to an allocation on another
(c10/cuda/CUDACachingAllocator.cpp ``get_free_block``: pools ordered by stream first).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from click.testing import CliRunner

import graphmem
from graphmem.cli import main
from graphmem.cuda.allocator import MemoryEvent, replay
from graphmem.cuda.nccl import DEFAULT_NCCL_BUFFER_MB
from graphmem.errors import UserInputError
from graphmem.job.parallel import ParallelSpec, parse_parallel
from graphmem.memory.cuda_replay import Stream, allocation_streams, op_streams
from graphmem.memory.results import Category, Lifetime, ModeReport
from graphmem.records import OpRecord, Phase, Role
from tests.parallel_cases import MLP, ParallelCase

MiB = 1 << 20
H100_CONTEXT = 500 * MiB  # the Hopper CUDA context graphmem assumes (docs/cuda-allocator.md)
CUDA = {"device": "cuda", "gpu": "h100-80gb"}


def _train(case: ParallelCase, **extra: Any) -> ModeReport:
    report = graphmem.analyze(**case.graphmem_keywords(), **CUDA, **extra)
    assert report.train is not None and report.train.allocator is not None
    return report.train


@pytest.fixture(scope="module")
def fsdp() -> ModeReport:
    return _train(ParallelCase(MLP, "fsdp", "adam"))


@pytest.fixture(scope="module")
def ddp() -> ModeReport:
    return _train(ParallelCase(MLP, "ddp", "adam"))


# -- which stream each allocation is made on --------------------------------------------------

def test_fsdp_all_gather_outputs_go_on_the_copy_in_stream(fsdp: ModeReport) -> None:
    streams = allocation_streams(fsdp.trace.ops, fsdp.lifetimes)
    copy_ins = [op for op in fsdp.trace.ops if op.op == "fsdp.all_gather_copy_in.default"]
    # two units (the MLP's two Linear layers), unsharded in forward and backward, two iterations
    assert len(copy_ins) == 8
    for op in copy_ins:  # all_gather_copy_in(inputs, out) returns views of its out buffer
        assert streams[op.outputs[0]] == Stream.ALL_GATHER_COPY_IN
    # the unsharded parameters are made by the copy-out on the default stream
    copy_outs = [op for op in fsdp.trace.ops if op.op == "fsdp.split_with_sizes_copy.default"]
    assert copy_outs and all(sid not in streams for op in copy_outs for sid in op.inputs[1:])


def test_fsdp_reduce_scatter_output_on_its_stream_input_on_the_default_one(fsdp: ModeReport) -> None:
    streams = allocation_streams(fsdp.trace.ops, fsdp.lifetimes)
    scatters = [op for op in fsdp.trace.ops if op.op == "c10d._reduce_scatter_base_.default"]
    assert len(scatters) == 4  # two units, two iterations
    for op in scatters:  # _reduce_scatter_base_(output, input)
        output, source = op.inputs
        assert streams[output] == Stream.REDUCE_SCATTER
        assert source not in streams
    # the rest: parameters, optimizer state, activations never leave the default stream
    held = {s.sid for s in fsdp.trace.storages if s.roles & {Role.PARAMETER, Role.OPTIMIZER_STATE, Role.SAVED}}
    assert not held & set(streams)
    assert set(streams.values()) == {Stream.ALL_GATHER_COPY_IN, Stream.REDUCE_SCATTER}


def test_a_reduce_dtype_cast_follows_the_reduce_scatter_onto_its_stream() -> None:
    # param_dtype bf16 without a reduce_dtype: the gradients are reduce-scattered in bf16, then
    # foreach_reduce casts the output to the parameters' fp32 under the reduce-scatter stream
    train = _train(ParallelCase(MLP, "fsdp", "sgd", {"param_dtype": "bfloat16"}))
    ops = train.trace.ops
    streams = allocation_streams(ops, train.lifetimes)
    casts = [ops[op.index + 1] for op in ops if op.op == "c10d._reduce_scatter_base_.default"]
    assert casts and all(cast.op == "aten._to_copy.default" for cast in casts)
    assert all(streams[cast.outputs[0]] == Stream.REDUCE_SCATTER for cast in casts)


def _op(index: int, name: str, inputs: tuple[int, ...] = (), outputs: tuple[int, ...] = (),
        module: str = "layers.2") -> OpRecord:
    return OpRecord(index, name, Phase.BACKWARD, 0, module, inputs, outputs, 0)


def test_hsdp_casts_on_the_all_reduce_stream_after_the_all_reduce() -> None:
    # foreach_reduce under HSDP: output allocated and reduce-scattered on the reduce-scatter
    # stream, all-reduced on the all-reduce stream, cast there (post_reduce_stream); the input
    # (sid 0, made by chunk_cat's buffer before the stream switch) and the next module's ops stay
    ops = (_op(0, "aten.empty.memory_format", outputs=(0,)), _op(1, "fsdp.chunk_cat.default", (0,)),
           _op(2, "aten.empty.memory_format", outputs=(1,)),
           _op(3, "c10d._reduce_scatter_base_.default", (1, 0), (1,)), _op(4, "c10d.allreduce_.default", (1,), (1,)),
           _op(5, "aten._to_copy.default", (1,), (2,)), _op(6, "aten.as_strided.default", (2,), (2,)),
           _op(7, "aten._to_copy.default", (2,), (3,), module="layers.1"))
    assert op_streams(ops) == {2: Stream.REDUCE_SCATTER, 3: Stream.REDUCE_SCATTER, 4: Stream.ALL_REDUCE,
                               5: Stream.ALL_REDUCE, 6: Stream.ALL_REDUCE}
    starts = ((0, 0), (1, 2), (2, 5), (3, 7))  # (sid, the op that made it)
    lifetimes = [Lifetime(sid, 512, start, 7, Category.COMMUNICATION) for sid, start in starts]
    assert allocation_streams(ops, lifetimes) == {1: Stream.REDUCE_SCATTER, 2: Stream.ALL_REDUCE}


def test_ddp_allocates_everything_on_the_default_stream(ddp: ModeReport) -> None:
    assert op_streams(ddp.trace.ops) == {}
    assert allocation_streams(ddp.trace.ops, ddp.lifetimes) == {}


def test_a_run_on_one_gpu_keeps_one_stream_and_no_nccl_buffers() -> None:
    report = graphmem.analyze("tests.models:MLP", ["8x1000"], mode="both", optimizer="adam", **CUDA)
    for mode in (report.inference, report.train):
        assert mode is not None and mode.allocator is not None
        assert op_streams(mode.trace.ops) == {}
        assert mode.allocator.nccl_buffer_bytes == 0


# -- separate pools per stream, by hand --------------------------------------------------------

def _reserved(events: list[MemoryEvent], streams: dict[int, int] | None) -> tuple[int, int]:
    stats = replay(events, streams=streams)
    return stats.allocated_peak_bytes, stats.reserved_peak_bytes


def test_a_block_freed_on_one_stream_is_not_reused_by_another() -> None:
    # 4 MiB: a multiple of 512, above kSmallSize -> large pool; below kMinLargeAlloc (10 MiB) ->
    # a kLargeBuffer (20 MiB) segment, split (4 MiB < max_split_size, 16 MiB > kSmallSize remain)
    events = [MemoryEvent("alloc", 1, 4 * MiB, 0), MemoryEvent("free", 1, 4 * MiB, 0),
              MemoryEvent("alloc", 2, 4 * MiB, 1)]
    assert _reserved(events, None) == (4 * MiB, 20 * MiB)      # one stream: the cached block is reused
    assert _reserved(events, {1: 1}) == (4 * MiB, 40 * MiB)    # freed on stream 1: a second segment
    assert _reserved(events, {1: 1, 2: 1}) == (4 * MiB, 20 * MiB)  # both on stream 1: reused again


def test_small_blocks_keep_their_stream_too() -> None:
    # 1000 B -> 1024 B (kMinBlockSize multiples), small pool, one kSmallBuffer (2 MiB) segment each
    events = [MemoryEvent("alloc", 1, 1000, 0), MemoryEvent("free", 1, 1000, 0),
              MemoryEvent("alloc", 2, 1000, 1)]
    assert _reserved(events, None) == (1024, 2 * MiB)
    assert _reserved(events, {2: 3}) == (1024, 4 * MiB)


# -- NCCL's own buffers ---------------------------------------------------------------------

def test_the_default_nccl_buffers_are_nccl_s_default_sizes_times_32_channels() -> None:
    # per channel: Simple 4 MiB (DEFAULT_BUFFSIZE) + LL 8 lines x 512 threads x 8 steps x 16 B
    # + LL128 120 elements x 640 threads x 8 steps x 8 B = 4,194,304 + 524,288 + 4,915,200 B
    assert DEFAULT_NCCL_BUFFER_MB * MiB == 32 * (4_194_304 + 524_288 + 4_915_200) == 308_281_344


@pytest.mark.parametrize("text, communicators", [
    ("ddp=2", 1), ("fsdp=8", 1), ("zero1=4", 1), ("tp=2", 1), ("ddp=2,fsdp=4", 2), ("fsdp=2,tp=2", 2),
    ("ddp=1,fsdp=4", 1), ("pp=2", 2), ("pp=4", 3),
])
def test_one_communicator_per_process_group(text: str, communicators: int) -> None:
    assert parse_parallel(text).communicators == communicators


def test_a_negative_nccl_buffer_is_refused() -> None:
    with pytest.raises(UserInputError, match="--nccl-buffer-mb must be 0 or more, got -1"):
        ParallelSpec((("ddp", 2),), nccl_buffer_mb=-1)


def test_ddp_holds_one_communicator_of_default_buffers(ddp: ModeReport) -> None:
    assert ddp.allocator is not None
    assert ddp.allocator.nccl_buffer_bytes == 308_281_344  # one process group, 294 MiB
    # not the caching allocator's: a run without it has the same allocated and reserved peaks
    without = _train(ParallelCase(MLP, "ddp", "adam"), nccl_buffer_mb=0)
    assert without.allocator is not None and without.allocator.nccl_buffer_bytes == 0
    assert (without.allocator.allocated_peak_bytes, without.allocator.reserved_peak_bytes) == \
        (ddp.allocator.allocated_peak_bytes, ddp.allocator.reserved_peak_bytes)


def _cli(*args: str) -> str:
    result = CliRunner().invoke(main, ["analyze", "tests.models:MLP", "--input", "8x1000", "--mode", "train",
                                       "--optimizer", "sgd", "--gpu", "h100-80gb", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_the_option_reaches_text_and_json() -> None:
    data = json.loads(_cli("--parallel", "ddp=2", "--nccl-buffer-mb", "10", "--format", "json"))
    train = data["train"]
    assert train["nccl_buffer_bytes"] == 10 * MiB  # one communicator of 10 MiB
    assert train["ranks"][0]["nccl_buffer_bytes"] == 10 * MiB
    # nvidia-smi counts them, like the CUDA context; the allocator's reserved peak does not
    assert train["nvidia_smi_estimate_bytes"] == train["reserved_peak_bytes"] + H100_CONTEXT + 10 * MiB
    text = _cli("--parallel", "ddp=2", "--nccl-buffer-mb", "10")
    assert re.search(r"NCCL buffers \(outside PyTorch's allocator\) +10\.00 MiB", text)
    assert "nvidia-smi estimate (+ CUDA context, NCCL buffers)" in text


def test_a_run_on_one_gpu_shows_no_nccl_buffers() -> None:
    data = json.loads(_cli("--format", "json"))
    assert "nccl_buffer_bytes" not in data["train"]
    assert data["train"]["nvidia_smi_estimate_bytes"] == data["train"]["reserved_peak_bytes"] + H100_CONTEXT
    # each metric labelled: active = allocated (no stream waits modelled), the context on its own
    assert data["train"]["active_peak_bytes"] == data["train"]["allocated_peak_bytes"]
    assert data["train"]["cuda_context_bytes"] == H100_CONTEXT
    text = _cli()
    for label in ("allocated peak (max_memory_allocated)", "peak active (active_bytes.all.peak)",
                  "reserved peak (max_memory_reserved)", "CUDA context (outside the allocator)",
                  "nvidia-smi estimate (+ CUDA context)"):
        assert label in text


def test_a_bad_nccl_buffer_size_is_a_usage_error() -> None:
    result = CliRunner().invoke(main, ["analyze", "tests.models:MLP", "--input", "8x1000", "--parallel", "ddp=2",
                                       "--nccl-buffer-mb", "-5"])
    assert result.exit_code == 2
    assert "--nccl-buffer-mb" in result.output


def test_check_counts_them_in_the_verdict() -> None:
    args = ["check", "tests.models:MLP", "--input", "8x1000", "--mode", "train", "--optimizer", "sgd",
            "--gpu", "h100-80gb", "--parallel", "ddp=2", "--nccl-buffer-mb", "10"]
    result = CliRunner().invoke(main, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["nccl_buffer_bytes"] == 10 * MiB
    # the verdict's bytes: the allocator's reserved peak + the CUDA context + NCCL's buffers
    assert data["metric"] == "reserved_peak_bytes"
    assert data["compared_bytes"] == data["reserved_peak_bytes"] + H100_CONTEXT + 10 * MiB
    text = CliRunner().invoke(main, args).output
    assert re.search(r"NCCL buffers +10\.00 MiB", text)
