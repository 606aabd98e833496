"""Names a module exports but imports on first use (PEP 562): importing the module loads none
of the heavy modules behind them (torch), so the command line parses its options, and prints
--help and usage errors, without them."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(namespace: dict[str, Any], where: Mapping[str, Sequence[str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``namespace`` (the module's ``globals()``).

    Args:
        namespace: the module's globals; each name, once imported, is kept there.
        where: module -> the names imported from it when first asked for.

    Returns:
        ``__getattr__(name)``: the name's value, or AttributeError for a name not in ``where``.
    """
    module_of = {name: module for module, names in where.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
