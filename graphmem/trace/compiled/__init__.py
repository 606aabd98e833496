"""torch.compile'd code recorded as inductor runs it, its kernels never run (``graphmem run``,
the CPU target).  inductor writes its code and builds its kernels in its own cache folder,
for real (``compiler_folders``: outside the program's file layer, graphmem.trace.program.scratch).

Input: the ``Recorder`` a program runs under.  Output: ``compiler(recorder)``, what the program's
``torch.compile`` (and ``nn.Module.compile``, which calls it) becomes while it runs.  dynamo,
AOTAutograd and inductor run for real on the program's fake tensors, at its first call, as in a
real run: dynamo's graphs and graph breaks (the eager code between them recorded as any), the
partitioner's choice of the tensors saved for backward (``activation_memory_budget`` as the
program sets it), inductor's fusions and its wrapper's buffers, allocated, reused and freed in
its order (graphmem._torch_api.compiled.replay_on_fakes: the allocations on fake tensors, the
kernels skipped), the compiled backward.  Knows nothing of the program's steps or reports.
"""

from __future__ import annotations

from graphmem.trace.compiled.compiler import compiler, compiler_folders

__all__ = ["compiler", "compiler_folders"]
