"""Optional packages a test needs, skipping that test alone (shown as skipped) where one is
missing: ``needs`` marks a test (the package is looked for, not imported, while tests are
collected); ``installed`` imports it inside the test, or inside the model builder it calls.
``extended`` marks a test that repeats a check on more budgets or models, run only with
GRAPHMEM_EXTENDED=1."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import pytest

__all__ = ["extended", "installed", "needs"]

_EXTRA = {"transformers": "hf", "huggingface_hub": "hf", "peft": "lora", "bitsandbytes": "qlora",
          "matplotlib": "viz", "pydot": "viz", "pulp": "plan", "pwlf": "dev"}


def _reason(package: str) -> str:
    extra = _EXTRA.get(package)
    return f"{package} is not installed" + (f" (pip install 'graphmem[{extra}]')" if extra else "")


def needs(*packages: str) -> pytest.MarkDecorator:
    """Skip the test where any of ``packages`` (top-level names) is not installed."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason="; ".join(_reason(p) for p in missing) or "installed")


def installed(package: str) -> ModuleType:
    """``package`` imported now; the calling test is skipped where it is not installed."""
    __tracebackhide__ = True  # the skip is reported at the caller's line
    return pytest.importorskip(package, reason=_reason(package))


def extended(what: str = "another case of the same check runs by default") -> pytest.MarkDecorator:
    """Skip the test unless GRAPHMEM_EXTENDED=1: the same check as a test that always runs, on
    more budgets or models (minutes on 2 cores; the whole suite must stay within CI's time)."""
    return pytest.mark.skipif(os.environ.get("GRAPHMEM_EXTENDED") != "1",
                              reason=f"{what}; set GRAPHMEM_EXTENDED=1 to run it")
