"""Per-op rules.  Importing this package registers every rule family."""

from __future__ import annotations

from graphmem.trace.rules import (  # noqa: F401  (register their rules)
    blas,
    bounds,
    grouped_mm,
    loss,
    normalization,
    quantized,
    rnn,
)
from graphmem.trace.rules.registry import ArgMeta, Rule, RuleTable, register, rules_for, scratch_bytes

__all__ = ["ArgMeta", "Rule", "RuleTable", "register", "rules_for", "scratch_bytes"]
