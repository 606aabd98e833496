"""Stage 2, trace: the real step recorded on fake tensors.

Input: a model on the meta device and a ``Job``'s inputs and step configuration.  Output: a
frozen ``Trace``: the torch.fx graph of aten ops (forward, the autograd engine's backward,
the optimizer step), each op's record and every storage's size, creator and release.
Holds the fake tensors (``fakes``), the recorder (``recorder``), the target's kernel choices
(``cuda_kernels``, ``cuda_autocast``), value assumptions (``values``), generation with a KV
cache (``generation``), the per-op scratch rules (``rules``), and repeated blocks recorded
once (``record``: ``blocks`` finds the stack, ``repeat`` places it).  Knows nothing of
categories, peaks, allocators, reports or the command line.
"""

from __future__ import annotations

from graphmem.trace.record import record_step
from graphmem.trace.records import OpRecord, Phase, Role, StorageRecord, Trace
from graphmem.trace.tracer import trace_step

__all__ = ["OpRecord", "Phase", "Role", "StorageRecord", "Trace", "record_step", "trace_step"]
