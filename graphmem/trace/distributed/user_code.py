"""The user's own code named on the command line (``--parallelize``, ``--tp-plan``), imported.

Input: ``pkg.module:NAME`` or ``path/file.py:NAME``.  Output: the object it names.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from graphmem.errors import UserInputError
from graphmem.job.option import spelling


def _import_function(text: str, option: str = f"{spelling('parallelize')}", what: str = "function") -> Any:
    """``pkg.module:NAME`` or ``path/file.py:NAME`` -> the object; a function for --parallelize."""
    module_name, _, attr = text.rpartition(":")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(f"graphmem_user_{Path(module_name).stem}", module_name)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot read {module_name}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        found = getattr(module, attr)
    except (ImportError, AttributeError, ValueError, FileNotFoundError) as exc:
        raise UserInputError(f"cannot load {option} {text!r}: {exc}; give pkg.module:{what}") from exc
    if what == "function" and not callable(found):
        raise UserInputError(f"{option} {text!r} is not a function")
    return found
