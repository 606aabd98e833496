"""The packages that export names lazily (graphmem._lazy): no exported name is also one of the
package's submodules.  Importing that submodule anywhere would set the package's attribute to
the module, so ``from package import name`` would then give the module, depending on what was
imported before (it did: ``graphmem.preflight.check`` the module and ``check`` the function)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

LAZY = ("graphmem", "graphmem.job", "graphmem.preflight", "graphmem.report")


@pytest.mark.parametrize("name", LAZY)
def test_no_exported_name_is_a_submodule(name: str) -> None:
    package = importlib.import_module(name)
    submodules = {info.name for info in pkgutil.iter_modules(package.__path__)}
    assert not set(package.__all__) & submodules
