"""A bare int as a device: the accelerator's index, as torch reads it on a GPU machine.

Input: the values a program gives as a device.  Output: ``as_gpu_device`` (``1`` ->
``cuda:1``, anything else as it is), for the Python layers that see a device before torch's
C++ argument parser does (``tensor.to(local_rank)``, ``model.to(local_rank)``,
``torch.zeros(n, device=local_rank)``: graphmem.trace.program.gpu), and ``int_devices()``,
under which ``torch.device(1)`` is ``cuda:1``.

Why: torch's C++ parser turns an int device into the current accelerator's device, and a
CPU-only torch has none ("Cannot access accelerator device when none is available"); Python
cannot answer that question for it.  ``torch.device`` is a C type nothing can subclass, so
inside ``int_devices()`` the name ``torch.device`` is a stand-in class: calling it makes
torch's own devices (an int alone: the GPU's index), and ``isinstance``/``issubclass``/``with``
ask torch's type.  A device is pickled (and deep-copied) through copyreg meanwhile, since
pickle finds a class by its name and ``torch.device`` is then the stand-in.
"""

from __future__ import annotations

import contextlib
import copyreg
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["as_gpu_device", "int_devices", "make_device"]

_TORCH_DEVICE: type = torch.device


def as_gpu_device(value: Any) -> Any:
    """``value`` as a device torch parses without an accelerator: an int (not a bool) is the GPU's
    index, ``cuda:value``; anything else is returned as it is."""
    if isinstance(value, int) and not isinstance(value, bool):
        return _TORCH_DEVICE("cuda", value)
    return value


def make_device(*args: Any, **kwargs: Any) -> Any:
    """``torch.device(...)`` as on a GPU machine: a bare int is the accelerator's (the GPU's) index."""
    if len(args) == 1 and not kwargs:
        return _TORCH_DEVICE(as_gpu_device(args[0]))
    return _TORCH_DEVICE(*args, **kwargs)


class _DeviceType(type):
    """The stand-in's type: instances and subclasses are torch's devices'; a call makes one."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _TORCH_DEVICE)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _TORCH_DEVICE)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return make_device(*args, **kwargs)

    def __getattr__(cls, name: str) -> Any:
        return getattr(_TORCH_DEVICE, name)


class _Device(metaclass=_DeviceType):
    """``torch.device`` while the program runs on the fake GPU (see the module docstring)."""


_Device.__module__, _Device.__name__, _Device.__qualname__ = "torch", "device", "device"


def _reduce(device: Any) -> tuple[Any, tuple[str]]:
    return make_device, (str(device),)


@contextlib.contextmanager
def int_devices() -> Iterator[None]:
    """Inside, ``torch.device(1)`` is ``cuda:1`` (and pickles and copies of devices work)."""
    if torch.device is not _TORCH_DEVICE:  # nested: already standing in
        yield
        return
    before = copyreg.dispatch_table.get(_TORCH_DEVICE)
    copyreg.dispatch_table[_TORCH_DEVICE] = _reduce
    torch.device = _Device  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        torch.device = _TORCH_DEVICE  # type: ignore[misc]
        if before is None:
            copyreg.dispatch_table.pop(_TORCH_DEVICE, None)
        else:
            copyreg.dispatch_table[_TORCH_DEVICE] = before
