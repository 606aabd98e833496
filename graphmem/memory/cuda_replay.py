"""Stage 3c (CUDA target): the caching allocator over a ModeReport's alloc/free sequence (pure).

Input: a ModeReport traced for the CUDA target, the GPU preset and the allocator settings.
Output: AllocatorStats — what ``torch.cuda.max_memory_allocated()`` and
``max_memory_reserved()`` would report.  Added to the tensors' own alloc/free sequence:
each op's scratch bytes (from the rules) and the cuBLAS workspace PyTorch allocates through
the caching allocator at the first cuBLAS call of each (handle, stream) and keeps: one for the
main thread (forward, loss, optimizer) and, in training, one for the autograd engine's
device thread (backward).  Source: aten/src/ATen/cuda/CublasHandlePool.cpp.
"""

from __future__ import annotations

from graphmem.cuda.alloc_conf import AllocatorConfig
from graphmem.cuda.allocator import AllocatorStats, replay
from graphmem.cuda.gpus import GPU, cublas_workspace_bytes
from graphmem.memory.alloc_events import ExtraAllocation, scratch_allocations, with_extra_allocations
from graphmem.memory.mode_report import memory_events
from graphmem.memory.results import ModeReport
from graphmem.trace.records import Phase

__all__ = ["model_cuda_allocator", "CUBLAS_OPS"]

# aten ops that run cuBLAS (GEMM / GEMV) on CUDA
CUBLAS_OPS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
                        "aten.addbmm.default", "aten.mv.default", "aten.addmv.default",
                        "aten._addmm_activation.default", "aten.dot.default", "aten.vdot.default"})


def model_cuda_allocator(report: ModeReport, gpu: GPU, config: AllocatorConfig,
                         cublas_config: str | None = None) -> AllocatorStats:
    """Replay the report's allocations through the caching allocator model.

    Args:
        report: a mode traced for the CUDA target.
        gpu: the GPU preset (its architecture sizes the cuBLAS workspace).
        config: allocator settings (PYTORCH_CUDA_ALLOC_CONF).
        cublas_config: the CUBLAS_WORKSPACE_CONFIG value, or None for PyTorch's default.
    """
    ops = report.trace.ops
    extras = scratch_allocations(ops)
    workspace = cublas_workspace_bytes(gpu, cublas_config)
    # one workspace per thread: the first cuBLAS op on the main thread, then in backward
    for i, threads in enumerate(({Phase.FORWARD, Phase.LOSS, Phase.OPTIMIZER}, {Phase.BACKWARD})):
        first = next((op for op in ops if op.op in CUBLAS_OPS and op.phase in threads), None)
        if first is not None:
            extras.append(ExtraAllocation(first.index, workspace, -(len(ops) + 2 + i), persistent=True))
    events = with_extra_allocations(memory_events(report.lifetimes, len(ops)), extras)
    return replay(events, config)
