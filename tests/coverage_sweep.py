"""benchmarks/coverage.py, the coverage sweep (docs/coverage.md), for the tests that take a
sample of it.  The sweep builds transformers models: ``coverage_sweep()`` is called inside a
test, which it skips where transformers is missing."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.conftest import ROOT
from tests.optional import installed

__all__ = ["coverage_sweep"]


def coverage_sweep() -> ModuleType:
    """benchmarks/coverage.py, imported under its own name (not the `coverage` package), after
    transformers (imported before anything is measured: its import-time tensors count in nothing)."""
    installed("transformers")
    name = "graphmem_benchmarks_coverage"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "coverage.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
