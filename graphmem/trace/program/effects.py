"""What a recorded program does outside the device, left undone: its checkpoint saves.

Input: a list the skipped saves are told to.  Output: ``skipping_saves``, a context manager
under which ``torch.save``, safetensors' ``save_file`` / ``save_model`` and torch's distributed
checkpoint ``save`` / ``async_save`` write nothing (the tensors are fakes: there is nothing to
write); a save to a path leaves an empty file there, in the program's own file layer
(graphmem.trace.program.scratch: the real file is never touched), so that a rename or an
existence check after it works; each skipped save is listed with the program's line that
asked for it.  ``save_pretrained`` saves through safetensors (or
``torch.save``), so it is skipped there; the config files it writes are written.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import runpy
import sys
import sysconfig
from collections.abc import Iterator
from typing import Any

import torch

from graphmem._torch_api import holds_fakes, storage_key
from graphmem.patching import patched, replaced_everywhere, when_imported

__all__ = ["frame_kind", "program_line", "skipping_saves"]

_RUNPY = frozenset({"<frozen runpy>", runpy.__file__})
_NOT_THE_PROGRAM = ("/torch/", "/graphmem/", "/safetensors/", "runpy.py", "<frozen", "<string>")


def program_line() -> str:
    """``file:line`` of the innermost frame on the stack in the program's own code (not an
    installed library's); else in an installed library's (transformers' Trainer, a recipe
    installed with its library), never torch's or graphmem's.  Only the frames inside the
    innermost ``runpy`` run count: the ones outside it ran the program (graphmem's command;
    a launcher script that runs the trainer with runpy, as torchtitan's ``-m`` launch)."""
    frame = sys._getframe(1)
    library = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path in _RUNPY:
            break
        kind = frame_kind(path)
        if kind == "program":
            return _line(path, frame.f_lineno)
        if kind == "library" and library is None:
            library = _line(path, frame.f_lineno)
        frame = frame.f_back  # type: ignore[assignment]
    return library or "?"


# Python's own modules (json, threading, ...): not the program's
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")


@functools.cache
def frame_kind(path: str) -> str:
    """"program", "library" (installed: site-packages) or "torch" (torch, graphmem, Python's own)."""
    if any(part in path for part in _NOT_THE_PROGRAM):
        return "torch"
    if "-packages/" in path:
        return "library"
    return "torch" if path.startswith(_STDLIB) else "program"


@functools.cache
def _line(path: str, lineno: int) -> str:
    shown = os.path.relpath(path)
    return f"{path if shown.startswith('..') else shown}:{lineno}"


def _where(target: Any) -> str:
    """Where a save would have written: its path, or what it was given."""
    if isinstance(target, (str, os.PathLike)):
        return os.fspath(target)
    return getattr(target, "name", type(target).__name__)


def _skip(skipped: list[str], what: str, target_at: int | str) -> Any:
    def save(*args: Any, **kwargs: Any) -> None:
        target = kwargs.get(target_at) if isinstance(target_at, str) else (
            args[target_at] if len(args) > target_at else kwargs.get("f", kwargs.get("filename")))
        skipped.append(f"{what} to {_where(target)} ({program_line()})")
        if isinstance(target, (str, os.PathLike)) and not what.startswith("torch.distributed"):
            # an empty file where the checkpoint would be, in the program's own file layer
            # (graphmem.trace.program.scratch): a rename or an existence check that follows works
            with open(target, "wb"):
                pass
    return save


def _optional(module: str, names: tuple[str, ...], what: str, target_at: int | str,
              skipped: list[str]) -> dict[Any, Any]:
    """An optional library's save functions -> their skipping ones (none where it is not installed)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return {}
    try:
        owner = importlib.import_module(module)
    except Exception:  # broad: a broken library may raise anything; it is not the program's to save with
        return {}
    return {getattr(owner, name): _skip(skipped, f"{what}.{name}", target_at) for name in names if hasattr(owner, name)}


# the libraries whose ``id_tensor_storage`` says which tensors of a state dict share memory, by
# ``data_ptr()``: every fake's is 0, so all would look shared and ``save_pretrained`` refuse
_STORAGE_IDS = ("transformers.pytorch_utils", "peft.utils.other", "accelerate.utils.modeling")


@contextlib.contextmanager
def _storage_ids_apart() -> Iterator[None]:
    """Inside, each library's ``id_tensor_storage`` tells fake tensors' storages apart: patched
    where the library is imported already (every module that bound it by name too), else as the
    program imports it (before the modules that bind it by name do)."""
    with contextlib.ExitStack() as stack:
        loaded = {}
        for name in _STORAGE_IDS:
            module = sys.modules.get(name)
            if module is not None and hasattr(module, "id_tensor_storage"):
                loaded[module.id_tensor_storage] = _fake_aware(module.id_tensor_storage)
            elif module is None:
                stack.enter_context(when_imported(name, lambda m: stack.enter_context(
                    patched((m, "id_tensor_storage", _fake_aware(m.id_tensor_storage))))
                    if hasattr(m, "id_tensor_storage") else None))
        stack.enter_context(replaced_everywhere(loaded, ("id_tensor_storage",)))
        yield


def _fake_aware(original: Any) -> Any:
    @functools.wraps(original)
    def id_tensor_storage(tensor: torch.Tensor) -> Any:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if not holds_fakes(local):
            return original(tensor)
        device, _, size = original(tensor)
        return device, storage_key(local)[0], size
    return id_tensor_storage


@contextlib.contextmanager
def skipping_saves(skipped: list[str]) -> Iterator[None]:
    """Inside, checkpoint saves write nothing; each is appended to ``skipped`` as
    ``"torch.save to PATH (file:line)"``.  A library that bound a save function by name (as
    transformers binds safetensors' ``save_file``) is given the skipping one too, and its own
    back afterwards."""
    savers = {torch.save: _skip(skipped, "torch.save", 1),
              **_optional("safetensors.torch", ("save_file", "save_model"), "safetensors", 1, skipped)}
    if "torch.distributed.checkpoint" in sys.modules:  # DCP: only a program that imported it saves with it
        savers |= _optional("torch.distributed.checkpoint", ("save", "async_save", "save_state_dict"),
                            "torch.distributed.checkpoint", "checkpoint_id", skipped)
    with replaced_everywhere(savers, ("save", "save_file", "save_model", "safe_save_file", "async_save",
                                      "save_state_dict")), \
            _storage_ids_apart():
        yield
