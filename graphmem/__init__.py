"""graphmem: predict the memory of a PyTorch training step before it runs.

The stages, each a package that imports only those before it:
job (what to analyse) -> trace (the step recorded on fake tensors) -> memory (liveness, peaks;
cuda: the caching allocator) -> api (``analyze``) -> preflight (check, search, plan) ->
report (renderers) -> cli.  See docs/how-it-works.md.

The stable public names are those in ``__all__``: ``analyze`` (and ``analyze_curve``: one
recording for every batch size or sequence length), the ``Job`` and
``make_job`` that describe what to analyse, and the result and error types.  Everything
else may change between releases.
"""

from __future__ import annotations

import warnings

# torch warns at import when NumPy is missing; graphmem never uses NumPy through torch.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from graphmem.api import PeakCurve, analyze, analyze_curve  # noqa: E402
from graphmem.errors import GraphmemError, OutputError, TraceError, UnsupportedError, UserInputError  # noqa: E402
from graphmem.job import InputSpec, Job, StepConfig, make_job, parse_input_spec  # noqa: E402
from graphmem.memory.results import Category, Lifetime, MemoryReport, ModeReport, PeakInfo, PhasePeak  # noqa: E402

__version__ = "0.1.0"

__all__ = ["analyze", "analyze_curve", "Category", "GraphmemError", "InputSpec", "Job", "Lifetime", "MemoryReport",
           "ModeReport", "OutputError", "PeakCurve", "PeakInfo", "PhasePeak", "StepConfig", "TraceError",
           "UnsupportedError", "UserInputError", "make_job", "parse_input_spec", "__version__"]
