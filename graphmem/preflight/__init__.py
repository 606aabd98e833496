"""Stage 5, pre-flight: answers on top of ``graphmem.analyze``.

Input: a ``Job`` and a ``Budget`` (``budget``).  Output: frozen answers: will it fit
(``check``), the largest batch or sequence that fits (``check.search_largest``), the peak
against the batch or sequence (``check.sweep``), and what
to change (``plan``, its rows, formulas and explanation).  Knows nothing of rendering or of
the command line.
"""

from __future__ import annotations

from graphmem.preflight.budget import Budget, parse_budget, resolve_budget
from graphmem.preflight.check import CheckResult, SearchResult, Sweep, check, search_largest, sweep
from graphmem.preflight.plan import Plan, make_plan

__all__ = ["Budget", "CheckResult", "Plan", "SearchResult", "Sweep", "check", "make_plan", "parse_budget",
           "resolve_budget", "search_largest", "sweep"]
