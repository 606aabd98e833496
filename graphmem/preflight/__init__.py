"""Stage 5, pre-flight: answers on top of ``graphmem.analyze``.

Input: a ``Job`` and a ``Budget`` (``budget``).  Output: frozen answers: will it fit
(``verdict.check``), the largest batch or sequence that fits (``search.search_largest``), the peak
against the batch or sequence (``search.sweep``), and what
to change (``plan``, its rows, formulas and explanation).  Each compares with the budget the
bytes ``footprint`` defines (on the CUDA target: the reserved peak plus the memory outside the
allocator).  Knows nothing of rendering or of the command line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphmem._lazy import lazy_exports

__all__ = ["Budget", "CheckResult", "Footprint", "Plan", "SearchResult", "Sweep", "check", "footprint_of",
           "make_plan", "parse_budget", "resolve_budget", "search_largest", "sweep"]

if TYPE_CHECKING:
    from graphmem.preflight.budget import Budget, parse_budget, resolve_budget
    from graphmem.preflight.footprint import Footprint, footprint_of
    from graphmem.preflight.plan import Plan, make_plan
    from graphmem.preflight.search import SearchResult, Sweep, search_largest, sweep
    from graphmem.preflight.verdict import CheckResult, check

# imported on first use: ``budget`` (the command line parses --budget with it) loads no torch
__getattr__ = lazy_exports(globals(), {
    "graphmem.preflight.budget": ("Budget", "parse_budget", "resolve_budget"),
    "graphmem.preflight.search": ("SearchResult", "Sweep", "search_largest", "sweep"),
    "graphmem.preflight.footprint": ("Footprint", "footprint_of"),
    "graphmem.preflight.plan": ("Plan", "make_plan"),
    "graphmem.preflight.verdict": ("CheckResult", "check"),
})
