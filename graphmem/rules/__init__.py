"""Per-op rules.  Importing this package registers every rule family."""

from __future__ import annotations

from graphmem.rules.registry import ArgMeta, Rule, register, rules_for, scratch_bytes

__all__ = ["ArgMeta", "Rule", "register", "rules_for", "scratch_bytes"]
