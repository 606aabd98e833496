"""Checkpoints a recorded program loads: read from their headers, never their weights.

Input: nothing.  Output: ``loading_headers_only``, a context manager under which safetensors'
``safe_open``, ``load_file`` and ``load`` give tensors of the stored shapes and dtypes made
where the program runs (fake ones, inside the recording), from the file's JSON header alone:
no weight is read, and a 70B checkpoint costs what its header costs.  Loaded on the CPU, they
are memory-mapped from the file as safetensors maps them: PyTorch's allocator allocates
nothing for them (a copy of them, to the GPU or in another dtype, is allocated as usual).  ``from_pretrained``
(transformers, peft, diffusers) loads through them.  ``torch.load`` needs nothing: inside
the recording's fake mode it gives fake tensors of the stored shapes already.

A library that bound ``safe_open`` by name before (``from safetensors import safe_open``) is
given the header reader too, and its own name back afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import struct
from collections.abc import Callable, Iterator
from typing import Any

import torch

from graphmem.patching import replaced_everywhere

__all__ = ["loading_headers_only"]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64}


def _header(data: bytes) -> dict[str, Any]:
    """The JSON header of a safetensors file's first bytes: 8 bytes of length, then the JSON."""
    (length,) = struct.unpack("<Q", data[:8])
    parsed: dict[str, Any] = json.loads(data[8:8 + length])
    return parsed


def _read_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a safetensors file, read alone (the weights after it are not)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        parsed: dict[str, Any] = json.loads(f.read(length))
        return parsed


_MAPPED: list[Callable[[torch.Tensor], None]] = []  # told of each tensor made, while loading_headers_only runs


def _made(entry: dict[str, Any], device: Any = "cpu") -> torch.Tensor:
    """A tensor of the entry's shape and dtype (its values are not read), mapped from the file."""
    where = "cpu" if device in (None, "cpu") or isinstance(device, int) else device
    t = torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]], device=where)
    for mapped in _MAPPED:
        mapped(t)
    return t


class _Slice:
    """``safe_open(...).get_slice(name)``: the shape, the dtype and any slice of it."""

    def __init__(self, entry: dict[str, Any], device: Any) -> None:
        self.entry, self.device = entry, device

    def get_shape(self) -> list[int]:
        return list(self.entry["shape"])

    def get_dtype(self) -> str:
        return str(self.entry["dtype"])

    def __getitem__(self, index: Any) -> torch.Tensor:
        return _made(self.entry, self.device)[index]


class _HeaderOnly:
    """``safetensors.safe_open`` answered from the file's header: keys, metadata, tensors of the
    stored shapes and dtypes."""

    def __init__(self, filename: str | os.PathLike[str], framework: str = "pt", device: Any = "cpu",
                 **options: Any) -> None:
        self.device = device
        header = _read_header(filename)
        self._metadata: dict[str, str] | None = header.pop("__metadata__", None)
        self._entries = header

    def __enter__(self) -> _HeaderOnly:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def keys(self) -> list[str]:
        return sorted(self._entries)

    def offset_keys(self) -> list[str]:
        return sorted(self._entries, key=lambda k: self._entries[k]["data_offsets"][0])

    def metadata(self) -> dict[str, str] | None:
        return self._metadata

    def get_tensor(self, name: str) -> torch.Tensor:
        return _made(self._entries[name], self.device)

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self._entries[name], self.device)


def _load_file(filename: str | os.PathLike[str], device: Any = "cpu") -> dict[str, torch.Tensor]:
    header = _read_header(filename)
    header.pop("__metadata__", None)
    return {name: _made(entry, device) for name, entry in header.items()}


def _load(data: bytes) -> dict[str, torch.Tensor]:
    header = _header(data)
    header.pop("__metadata__", None)
    return {name: _made(entry) for name, entry in header.items()}


@contextlib.contextmanager
def loading_headers_only(mapped: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Inside, safetensors loads read headers only (see the module docstring); ``mapped(t)`` is
    told of each tensor made so on the CPU: safetensors maps it from the file, memory PyTorch's
    allocator does not allocate.  So is each tensor ``torch.frombuffer`` makes over the
    program's bytes (torchvision's MNIST reads its files so): it shares the buffer's memory.
    Nothing changes for safetensors where it is not installed."""
    frombuffer = torch.frombuffer

    def over_the_buffer(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = frombuffer(*args, **kwargs)
        mapped(t)
        return t

    with contextlib.ExitStack() as stack:
        stack.enter_context(replaced_everywhere({frombuffer: over_the_buffer}, ("frombuffer",)))
        if importlib.util.find_spec("safetensors") is not None:
            import safetensors
            import safetensors.torch

            _MAPPED.append(mapped)
            stack.callback(_MAPPED.remove, mapped)
            readers = {safetensors.safe_open: _HeaderOnly, safetensors.torch.load_file: _load_file,
                       safetensors.torch.load: _load}
            stack.enter_context(replaced_everywhere(readers, ("safe_open", "load_file", "load", "safe_load_file")))
        yield
