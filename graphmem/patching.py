"""Patch-and-restore: attributes replaced for the length of a ``with`` block (pure helpers)."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

__all__ = ["environment", "patched", "replaced_everywhere", "when_imported"]

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


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Inside, ``os.environ`` holds ``values``; on exit each variable is as it was (unset again
    where it was unset)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def replaced_everywhere(table: dict[Any, Any], names: tuple[str, ...]) -> Iterator[None]:
    """Inside, every loaded module's attribute named in ``names`` whose value is a key of
    ``table`` holds that key's value instead (a function imported by name, ``from x import f``,
    included); on exit, every module's attribute that holds a replacement, those bound inside
    too, holds its original again."""
    def bound_to(wanted: dict[Any, Any]) -> list[tuple[Any, str, Any]]:
        found = []
        for module in list(sys.modules.values()):
            for name in names:
                value = getattr(module, name, None) if module is not None else None
                if value is not None and _hashable(value) and value in wanted:
                    found.append((module, name, wanted[value]))
        return found

    with patched(*bound_to(table)):
        try:
            yield
        finally:
            for module, name, original in bound_to({new: old for old, new in table.items()}):
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(module, name, original)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds module ``name`` as the other finders do, and calls ``then(module)`` once it has
    been executed."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        execute, then = loader.exec_module, self.then

        def exec_module(module: ModuleType) -> None:
            execute(module)
            then(module)

        loader.exec_module = exec_module  # (this module's own loader)
        return spec


@contextlib.contextmanager
def when_imported(name: str, then: Callable[[ModuleType], None]) -> Iterator[None]:
    """``then(module)`` now if module ``name`` is imported, else when it is, inside."""
    if name in sys.modules:
        then(sys.modules[name])
        yield
        return
    finder = _AfterImport(name, then)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(finder)
