"""Stage 2, trace: the real step recorded on fake tensors.

Input: a model on the meta device and a ``Job``'s inputs and step configuration.  Output: a
frozen ``Trace`` (graphmem.records): the torch.fx graph of aten ops (forward, the autograd
engine's backward, the optimizer step), each op's record and every storage's size, creator
and release.  Knows nothing of categories, peaks, allocators, reports or the command line.

The rooms, each importing only the ones below it (checked by import-linter):

- ``program`` (a whole training program as it runs, ``graphmem run``; its model's stack of
  alike blocks recorded once through ``repeat``), then ``repeat`` (a stack of alike blocks
  recorded once) and ``ranks`` (ZeRO-1 ranks forked from one recording): the entry points,
  above the recording;
- ``recording``: ``trace_step`` and ``Recording``, what one recording is;
- ``step``: the step drivers, run under the recorder as a trainer runs them;
- ``distributed`` (PyTorch's engines under a fake process group), ``cuda_target`` (CUDA's
  kernel and autocast choices on fake CPU tensors);
- ``core``: the dispatch mode and its books (storages, modules, the fx graph);
- ``values``: answers to reads of values fake tensors do not hold (the core asks them);
- ``rules``: the per-op registry.

``symbolic`` (a trace at another size of its size symbol) is a pure pass over a ``Trace``.
"""

from __future__ import annotations

from graphmem.trace.cuda_target.kernels import CudaKernels
from graphmem.trace.distributed import distinct_ranks
from graphmem.trace.distributed.fsdp import finer_units, fsdp_units
from graphmem.trace.ranks import forks_ranks, record_ranks
from graphmem.trace.recording import Recording
from graphmem.trace.repeat import record_step
from graphmem.trace.symbolic import trace_at

# what analyze needs; a program's recording is the room's own (graphmem.trace.program)
__all__ = ["CudaKernels", "Recording", "distinct_ranks", "finer_units", "forks_ranks", "fsdp_units", "record_ranks",
           "record_step", "trace_at"]
