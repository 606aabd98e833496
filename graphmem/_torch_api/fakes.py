"""Fake tensors: FakeTensorMode, making and telling fakes, what fake kernels raise, and the
places torch must treat a fake as a plain tensor or as on another device."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["DATA_DEPENDENT_ERRORS", "DynamicOutputShapeException", "FakeTensor", "FakeTensorMode", "OP_ERRORS",
           "UnsupportedOperatorException", "fake_like", "fake_mode_without_cuda", "fakes_shown_on",
           "fakes_take_foreach_paths", "holds_fakes", "is_fake", "quiet_fake_tensor_logs", "to_fake",
           "unset_fake_temporarily"]

# What an aten op, a meta kernel or a flop formula raises on arguments it does not accept
# (NotImplementedError is a RuntimeError; sympy's and FakeTensor's refusals derive from these).
OP_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, AssertionError)

# Raised by FakeTensor when a model reads a tensor's value or creates a value-dependent shape.
DATA_DEPENDENT_ERRORS = (DataDependentOutputException, DynamicOutputShapeException)


def to_fake(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Turn a meta tensor into a fake tensor on ``device`` with the same shape and strides.

    The fake tensor reports ``device`` (so device-dependent code paths take the target's
    branch) but keeps no memory: it is backed by a meta storage.
    """
    converter = mode.fake_tensor_converter
    return converter.from_meta_and_device(mode, meta, device)


@contextlib.contextmanager
def quiet_fake_tensor_logs() -> Iterator[None]:
    """Silence FakeTensor's own error log (a traceback per failing meta kernel); graphmem
    reports the failure itself, in one line.  Also bitsandbytes' warning, at every int8
    matmul, that it casts its input to float16 (true of the real run too, and not a memory
    fact the report leaves out: the cast is recorded)."""
    loggers = [logging.getLogger(name) for name in ("torch._subclasses.fake_tensor", "bitsandbytes")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (else a real one, or a meta tensor)."""
    return isinstance(t, FakeTensor)


def holds_fakes(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor or a tensor subclass around fake ones (a DTensor whose
    local tensor is fake): either way it holds no values of its own."""
    if is_fake(t):
        return True
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return any(holds_fakes(inner) for inner in (getattr(t, name) for name in names)
                   if isinstance(inner, torch.Tensor))
    return False


@contextlib.contextmanager
def fakes_take_foreach_paths() -> Iterator[None]:
    """Fake tensors count as plain tensors where torch picks its foreach kernels (the optimizers'
    default implementation, clip_grad_norm_): a program on fakes takes the path it takes on
    real tensors (as DTensor registers itself in the same two lists)."""
    import torch.optim.optimizer as optimizer
    import torch.utils._foreach_utils as foreach_utils

    lists: list[list[Any]] = [optimizer._foreach_supported_types, foreach_utils._foreach_supported_types]
    added = [kinds for kinds in lists if FakeTensor not in kinds]
    for kinds in added:
        kinds.append(FakeTensor)
    try:
        yield
    finally:
        for kinds in added:
            kinds.remove(FakeTensor)


@contextlib.contextmanager
def fake_mode_without_cuda() -> Iterator[None]:
    """What a FakeTensorMode sets up when CUDA is unavailable (``avoid_device_init``), kept while
    ``torch.cuda.is_available()`` is made to say yes: ``torch.tensor(..., device="cuda")`` lifts
    its data as a CPU tensor, and a no-op CUDA device guard stands in for the missing one."""
    before = torch._C._only_lift_cpu_tensors()
    torch._C._set_only_lift_cpu_tensors(True)
    torch._C._ensureCUDADeviceGuardSet()
    try:
        yield
    finally:
        torch._C._set_only_lift_cpu_tensors(before)


def fake_like(like: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """A fake tensor of ``meta``'s metadata in fake ``like``'s mode, on the device ``like`` is made on
    (the CPU, or meta), whatever ``like.device`` shows the program (``fakes_shown_on``)."""
    assert isinstance(like, FakeTensor), f"fake_like: {type(like).__name__} is no fake tensor"
    return to_fake(like.fake_mode, meta, like.fake_device)


@contextlib.contextmanager
def fakes_shown_on(where: Callable[[torch.Tensor], torch.device | None]) -> Iterator[None]:
    """A fake tensor says it is on ``where(t)`` to Python code (``.device``, ``.is_cuda``), so
    ``torch.zeros(n, device=x.device)`` asks for that device; inside torch's kernels and where
    ``where`` says None, it is on its own fake device as before: the device chosen per tensor
    and per moment (a rank's GPU index).  The C++ side (the autograd engine) keeps the fake
    device."""
    original = FakeTensor.__dict__["device"]

    def device_of(self: FakeTensor) -> torch.device:
        own: torch.device = original.fget(self)
        shown = where(self) if own.type != "meta" else None
        return own if shown is None else shown

    FakeTensor.device = property(device_of, original.fset)  # type: ignore[method-assign,assignment]
    FakeTensor.is_cuda = property(lambda self: device_of(self).type == "cuda")  # type: ignore[assignment]
    try:
        yield
    finally:
        FakeTensor.device = original  # type: ignore[method-assign]
        del FakeTensor.is_cuda
