"""A training program recorded as it runs (``graphmem run``).

Input: a ``Program`` (a script or ``-m`` module, its argv, the optimizer steps to record, its
ranks) and, for a GPU, a ``GpuTarget``.  Output: a ``ProgramTrace`` for each rank recorded.
Knows nothing of categories, peaks, allocators, reports or the command line (the GPU's memory
answers are a function it is given).

- ``launch``: the ranks to record, each in a process of its own as torchrun starts them, in
  rounds until their pipeline stages' messages agree;
- ``run``: the program under the recorder as Python runs it (``as_main``), stopped after its
  K-th step; ``ending``: how its run ended, in the user's words;
- ``books``: the global hooks that name its models, inputs, outputs, gradients, optimizer
  state and steps;
- ``gpu``: the program's "cuda" as the target GPU on fake CPU tensors: which storages are on
  the GPU, what the program's ``torch.cuda`` calls answer;
- ``ranks``: one rank of a torchrun-style launch, on torch's fake process group;
- ``loads`` and ``effects``: checkpoints read from their headers only, saves skipped, the
  program's own line for each op;
- ``stage_messages``: what a pipelined program's stages tell each other, carried between
  the ranks' recordings;
- ``stacks``: the program's model built with four of its stack of alike blocks, the others
  placed in the recording after (graphmem.trace.repeat).
"""

from __future__ import annotations

from graphmem.trace.program.gpu import GpuMemory, GpuTarget
from graphmem.trace.program.launch import Launched, record_program
from graphmem.trace.program.run import ProgramTrace, Spoiled, trace_program
from graphmem.trace.program.stage_messages import Exchanged, Mailbox, Waits

__all__ = ["Exchanged", "GpuMemory", "GpuTarget", "Launched", "Mailbox", "ProgramTrace", "Spoiled", "Waits",
           "record_program", "trace_program"]
