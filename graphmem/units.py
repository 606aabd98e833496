"""Byte units: their names and sizes, and bytes as text; durations (--timeout) as seconds.  Shared by
every stage; imports nothing of graphmem."""

from __future__ import annotations

import re

__all__ = ["BINARY_UNITS", "UNITS", "format_bytes", "parse_duration"]

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


_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|min|h)?\s*", re.IGNORECASE)
_UNIT_S = {"ms": 0.001, "s": 1.0, "": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``1.5m``, ``10min``, ``2h``, ``500ms``; ValueError otherwise."""
    match = _DURATION.fullmatch(text)
    seconds = float(match.group(1)) * _UNIT_S[(match.group(2) or "").lower()] if match else 0.0
    if seconds <= 0:
        raise ValueError(f"{text!r} is not a duration such as 90s, 10m or 2h")
    return seconds
