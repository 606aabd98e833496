"""Byte units: their names and sizes, and bytes as text.  Shared by every stage; imports nothing
of graphmem."""

from __future__ import annotations

__all__ = ["BINARY_UNITS", "UNITS", "format_bytes"]

# Binary byte units, shared by the renderers and budget parsing.
BINARY_UNITS: dict[str, int] = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
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
