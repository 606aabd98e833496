"""graphmem: predict the memory of a PyTorch training step before it runs.

The public names: ``analyze`` and the result and error types.
"""

from __future__ import annotations

from graphmem.api import analyze
from graphmem.errors import GraphmemError, TraceError, UnsupportedError, UserInputError
from graphmem.spec import InputSpec, parse_input_spec
from graphmem.types import Category, Lifetime, MemoryReport, ModeReport, PeakInfo, PhasePeak

__version__ = "0.1.0"

__all__ = ["analyze", "Category", "GraphmemError", "InputSpec", "Lifetime", "MemoryReport",
           "ModeReport", "PeakInfo", "PhasePeak", "TraceError", "UnsupportedError",
           "UserInputError", "parse_input_spec", "__version__"]
