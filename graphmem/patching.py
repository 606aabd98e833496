"""Patch-and-restore: attributes replaced for the length of a ``with`` block (pure helper)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["patched"]

_MISSING = object()


@contextlib.contextmanager
def patched(*replacements: tuple[Any, str, Any]) -> Iterator[None]:
    """Inside, ``owner.name`` is ``value`` for each ``(owner, name, value)``; on exit (an
    exception too) each is restored, and an attribute the owner did not have itself (one it
    inherited) is removed again.  Nested uses restore in order."""
    saved = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in replacements]
    try:
        for owner, name, value in replacements:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, original)
