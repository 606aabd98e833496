"""Stage 3c (CUDA target): the caching allocator over a ModeReport's alloc/free sequence (pure).

Input: a ModeReport traced for the CUDA target, the GPU preset and the allocator settings.
Output: AllocatorStats — what ``torch.cuda.max_memory_allocated()`` and
``max_memory_reserved()`` would report.  Added to the tensors' own alloc/free sequence:
each op's scratch bytes (from the rules) and the cuBLAS workspace PyTorch allocates through
the caching allocator at the first cuBLAS call of each (handle, stream) and keeps: one for the
main thread (forward, loss, optimizer) and, in training, one for the autograd engine's
device thread (backward).  Source: aten/src/ATen/cuda/CublasHandlePool.cpp.

Streams (``--parallel``): the caching allocator keeps the blocks of each CUDA stream apart, a
block freed on one stream is never handed to an allocation on another.  Which allocations run
on which stream in a real run is read off the recorded ops (``allocation_streams``); what each
choice rests on, in torch 2.13's source:

- FSDP2's all-gather (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py
  ``foreach_all_gather``): the all-gather output, and with a MixedPrecisionPolicy the flat
  cast copy of the shards, are allocated under ``device_handle.stream(all_gather_copy_in_stream)``
  up to ``fsdp.all_gather_copy_in``; that stream is the copy-in stream in forward and backward
  prefetch (``FSDPCommContext.get_all_gather_streams``, _fsdp_param_group.py).  The output is
  freed by dropping the last reference after the copy-in stream waited for the copy-out event
  (``_wait_all_gather_streams_on_event``), with no ``record_stream``: the block goes straight
  back to the copy-in stream's pool.  The unsharded parameters are allocated in the copy-out,
  on the default stream.
- FSDP2's reduce-scatter (``foreach_reduce``): its input is allocated on the default stream
  (before the ``reduce_scatter_stream`` context), its output (which becomes the sharded
  gradient) under ``device_handle.stream(reduce_scatter_stream)``, and so is the cast to the
  parameters' dtype when the reduce dtype differs; with HSDP that cast runs on the
  all-reduce stream after ``dist.all_reduce``.
- DDP (torch/nn/parallel/distributed.py, the reducer): buckets are allocated at construction
  and reduced in place by the comm hook; tensor parallel: the functional collectives allocate
  their outputs on the caller's stream (torch/csrc/distributed/c10d/Functional.cpp); both stay
  on the default stream.  NCCL runs every collective on a stream of its own but allocates
  nothing there through PyTorch.

Not modelled: a block freed while a collective on another stream still uses it waits for that
stream's event before it is reused (``record_stream``, or ProcessGroupNCCL stashing tensors);
an explicit ``unshard()`` or ``unshard_async_op`` (all-gathers on the default stream).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from enum import IntEnum, unique

from graphmem.cuda.alloc_conf import AllocatorConfig
from graphmem.cuda.allocator import AllocatorStats, replay
from graphmem.cuda.gpus import GPU, cublas_workspace_bytes
from graphmem.cuda.nccl import nccl_buffer_bytes
from graphmem.job.parallel import ParallelSpec
from graphmem.memory.alloc_events import ExtraAllocation, scratch_allocations, with_extra_allocations
from graphmem.memory.mode_report import memory_events
from graphmem.memory.results import Lifetime, ModeReport
from graphmem.records import OpRecord, Phase

__all__ = ["CUBLAS_OPS", "Stream", "allocation_streams", "model_cuda_allocator", "op_streams"]

# aten ops that run cuBLAS (GEMM / GEMV) on CUDA
CUBLAS_OPS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
                        "aten.addbmm.default", "aten.mv.default", "aten.addmv.default",
                        "aten._addmm_activation.default", "aten.dot.default", "aten.vdot.default"})


@unique
class Stream(IntEnum):
    """The CUDA streams allocations are made on (ids for ``replay``'s ``streams``)."""

    DEFAULT = 0             # the current stream: compute, DDP, tensor parallel, FSDP2's copy-out
    ALL_GATHER_COPY_IN = 1  # FSDP2's all_gather_copy_in_stream
    REDUCE_SCATTER = 2      # FSDP2's reduce_scatter_stream
    ALL_REDUCE = 3          # FSDP2's all_reduce_stream (HSDP)


_ALL_GATHER_COPY_IN = "fsdp.all_gather_copy_in.default"
_REDUCE_SCATTER = "c10d._reduce_scatter_base_.default"
_ALL_REDUCE = "c10d.allreduce_.default"
# what foreach_all_gather runs under the copy-in stream before all_gather_copy_in: the flat
# cast buffer, its split and foreach copy (_get_param_all_gather_inputs), uint8 views, the output
_COPY_IN_OPS = frozenset({"aten.empty.memory_format", "aten.split_with_sizes.default",
                          "aten._foreach_copy_.default", "aten.view.dtype"})
# what foreach_reduce runs under the reduce-scatter stream before the collective: the output, the predivide
_REDUCE_SCATTER_OPS = frozenset({"aten.empty.memory_format", "aten.div_.Scalar", "aten.div_.Tensor"})
# ... and after it: the HSDP all-reduce, accumulations, the postdivide, the cast, the gradient views
_POST_REDUCE_OPS = frozenset({_ALL_REDUCE, "aten.add_.Tensor", "aten.div_.Scalar", "aten.div_.Tensor",
                              "aten._to_copy.default", "aten.as_strided.default"})


def model_cuda_allocator(report: ModeReport, gpu: GPU, config: AllocatorConfig,
                         cublas_config: str | None = None, parallel: ParallelSpec | None = None) -> AllocatorStats:
    """Replay the report's allocations through the caching allocator model, each on its stream.

    Args:
        report: a mode traced for the CUDA target.
        gpu: the GPU preset (its architecture sizes the cuBLAS workspace).
        config: allocator settings (PYTORCH_CUDA_ALLOC_CONF).
        cublas_config: the CUBLAS_WORKSPACE_CONFIG value, or None for PyTorch's default.
        parallel: the run's parallelism; it sizes NCCL's buffers (``nccl_buffer_bytes``).

    Returns:
        AllocatorStats; ``nccl_buffer_bytes`` is 0 without ``parallel``.
    """
    ops = report.trace.ops
    extras = scratch_allocations(ops)
    workspace = cublas_workspace_bytes(gpu, cublas_config)
    # one workspace per thread: the first cuBLAS op on the main thread, then in backward
    for i, threads in enumerate(({Phase.PROGRAM, Phase.FORWARD, Phase.LOSS, Phase.OPTIMIZER}, {Phase.BACKWARD})):
        first = next((op for op in ops if op.op in CUBLAS_OPS and op.phase in threads), None)
        if first is not None:
            extras.append(ExtraAllocation(first.index, workspace, -(len(ops) + 2 + i), persistent=True))
    events = with_extra_allocations(memory_events(report.lifetimes, len(ops)), extras)
    by_op = op_streams(ops)
    streams = allocation_streams(ops, report.lifetimes, by_op)
    # kernel scratch goes on the stream of its op
    streams.update({extra.sid: by_op[extra.step] for extra in extras if extra.step in by_op and not extra.persistent})
    stats = replay(events, config, streams=streams or None)
    if parallel is None:
        return stats
    return replace(stats, nccl_buffer_bytes=nccl_buffer_bytes(parallel.communicators, parallel.nccl_buffer_mb))


def op_streams(ops: Sequence[OpRecord]) -> dict[int, int]:
    """The ops that run on a stream other than the default one in a real run (FSDP2's
    collectives and what it runs beside them, see the module docstring): op index -> Stream.

    Args:
        ops: the recorded ops, in order.

    Returns:
        Op index -> stream id; ops not listed run on the default stream (0).
    """
    streams: dict[int, int] = {}
    for op in ops:
        if op.op == _ALL_GATHER_COPY_IN:
            for k in (*_run(ops, op.index, _COPY_IN_OPS, -1), op.index):
                streams[k] = Stream.ALL_GATHER_COPY_IN
        elif op.op == _REDUCE_SCATTER:
            stream = Stream.REDUCE_SCATTER
            for k in (*_run(ops, op.index, _REDUCE_SCATTER_OPS, -1), op.index):
                streams[k] = stream
            # after HSDP's all-reduce, foreach_reduce continues on the all-reduce stream
            for k in _run(ops, op.index, _POST_REDUCE_OPS, 1):
                stream = Stream.ALL_REDUCE if ops[k].op == _ALL_REDUCE else stream
                streams[k] = stream
    return streams


def _run(ops: Sequence[OpRecord], index: int, names: frozenset[str], direction: int) -> list[int]:
    """The ops next to op ``index`` (before it: direction -1; after: 1) that are in ``names``
    and belong to the same phase, iteration and module, nearest first."""
    anchor, found = ops[index], []
    k = index + direction
    while 0 <= k < len(ops) and ops[k].op in names and (ops[k].phase, ops[k].iteration, ops[k].module) \
            == (anchor.phase, anchor.iteration, anchor.module):
        found.append(k)
        k += direction
    return found


def allocation_streams(ops: Sequence[OpRecord], lifetimes: Iterable[Lifetime],
                       by_op: dict[int, int] | None = None) -> dict[int, int]:
    """The stream each storage is allocated on, for those not on the default stream: the
    stream of the op that created it (``op_streams``).  A storage that first appears at an op
    without being one of its outputs (FSDP2 regrowing a parameter between two ops) stays on
    the default stream.

    Returns:
        Storage id -> stream id, as ``graphmem.cuda.allocator.replay`` takes it.
    """
    by_op = op_streams(ops) if by_op is None else by_op
    return {life.sid: by_op[life.start] for life in lifetimes
            if life.start in by_op and life.sid in ops[life.start].outputs}
