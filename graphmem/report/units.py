"""Byte formatting for the human-readable renderers."""

from __future__ import annotations

from graphmem.spec import BINARY_UNITS

__all__ = ["UNITS", "format_bytes"]

UNITS = BINARY_UNITS


def format_bytes(n: int, units: str = "auto") -> str:
    """``n`` bytes as text: ``"12.35 MiB"``; ``units="auto"`` picks the largest unit <= n."""
    if units == "auto":
        units = next((u for u in reversed(UNITS) if abs(n) >= UNITS[u]), "B")
    if units not in UNITS:
        raise ValueError(f"format_bytes: unknown units {units!r}; expected auto or one of {list(UNITS)}")
    if units == "B":
        return f"{n:,} B"
    return f"{n / UNITS[units]:,.2f} {units}"
