"""The GPU and its caching allocator, as a model of the hardware: the GPU table
(``gpus``), PYTORCH_CUDA_ALLOC_CONF (``alloc_conf``), a replay of PyTorch's
CUDACachingAllocator over a sequence of allocations and frees (``allocator``) and NCCL's own
buffers outside it (``nccl``).

Input: GPU names, allocator settings, ``MemoryEvent`` sequences.  Output: ``GPU``,
``AllocatorConfig`` and ``AllocatorStats`` records.  Knows nothing of models, graphs or
traces, so every stage above may use it.
"""

from __future__ import annotations

from graphmem.cuda.alloc_conf import AllocatorConfig, parse_alloc_conf
from graphmem.cuda.allocator import AllocatorStats, MemoryEvent, replay
from graphmem.cuda.gpus import GPU, GPUS, get_gpu

__all__ = ["GPU", "GPUS", "AllocatorConfig", "AllocatorStats", "MemoryEvent", "get_gpu", "parse_alloc_conf",
           "replay"]
