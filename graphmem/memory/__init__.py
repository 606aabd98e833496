"""Stage 3, memory: liveness and the memory model.

Input: a ``Trace``.  Output: each storage's ``Lifetime`` and category (``liveness``), the
live bytes after every op, the peaks and what is live there (``mode_report``: a frozen
``ModeReport``), the module each op's and storage's bytes are charged to (``attribution``:
the optimizer step's to the optimizer step), and on the CUDA target the caching allocator's
view (``cuda_replay``).
The result types of the whole analysis live in ``results``.  Knows nothing of how the
trace was recorded, of reports or of the command line.
"""

from __future__ import annotations

from graphmem.memory.liveness import compute_lifetimes
from graphmem.memory.mode_report import build_mode_report, memory_events
from graphmem.memory.results import (
    Category,
    GenerateReport,
    Lifetime,
    MemoryReport,
    ModeReport,
    PeakInfo,
    PhasePeak,
)

__all__ = ["Category", "GenerateReport", "Lifetime", "MemoryReport", "ModeReport", "PeakInfo", "PhasePeak",
           "build_mode_report", "compute_lifetimes", "memory_events"]
