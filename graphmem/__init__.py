"""graphmem: predict the memory of a PyTorch training step before it runs.

The public names: ``analyze`` and the result and error types.
"""

from __future__ import annotations

import warnings

# torch warns at import when NumPy is missing; graphmem never uses NumPy through torch.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from graphmem.api import analyze  # noqa: E402
from graphmem.errors import GraphmemError, TraceError, UnsupportedError, UserInputError  # noqa: E402
from graphmem.spec import InputSpec, parse_input_spec  # noqa: E402
from graphmem.types import Category, Lifetime, MemoryReport, ModeReport, PeakInfo, PhasePeak  # noqa: E402

__version__ = "0.1.0"

__all__ = ["analyze", "Category", "GraphmemError", "InputSpec", "Lifetime", "MemoryReport",
           "ModeReport", "PeakInfo", "PhasePeak", "TraceError", "UnsupportedError",
           "UserInputError", "parse_input_spec", "__version__"]
