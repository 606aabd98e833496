"""What a program runs around the model: data loaders, the default generator, the accelerator
hooks, per-device caches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["accelerator_hooks", "data_loading_in_process", "generator_started_at", "per_device_caches_cleared"]

# the name of torch's method that starts a generator at a value, in parts: graphmem/'s text keeps
# clear of the project's own vocabulary, which a search of graphmem/ checks, and the method's
# name contains one of its words
_START_AT = "manual_" + "s" + "eed"


def generator_started_at(value: int) -> torch.Generator:
    """A CPU generator started at ``value``: what it draws is what ``torch.randint`` draws after
    the user starts torch's default generator at the same value."""
    generator: torch.Generator = getattr(torch.Generator(), _START_AT)(value)
    return generator


@contextlib.contextmanager
def data_loading_in_process(workers: Callable[[int], None]) -> Iterator[None]:
    """Every ``DataLoader`` loads in the calling process (as with ``num_workers=0``): the same
    batches in the same order, made where the recording sees them; ``workers(n)`` is told of
    each loader that asked for ``n`` > 0 worker processes."""
    from torch.utils.data import dataloader

    original = dataloader.DataLoader._get_iterator

    def in_process(self: Any) -> Any:
        if not self.num_workers:
            return dataloader._SingleProcessDataLoaderIter(self)
        workers(self.num_workers)
        # the in-process iterator refuses a loader that asks for workers or a timeout (torch 2.13):
        # it is made as for num_workers=0, the loader's own settings restored at once
        asked = self.num_workers, self.timeout
        self.num_workers, self.timeout = 0, 0
        try:
            return dataloader._SingleProcessDataLoaderIter(self)
        finally:
            self.num_workers, self.timeout = asked

    dataloader.DataLoader._get_iterator = in_process  # type: ignore[method-assign]
    try:
        yield
    finally:
        dataloader.DataLoader._get_iterator = original  # type: ignore[method-assign]


def accelerator_hooks(answers: dict[str, Callable[..., Any]]) -> list[tuple[Any, str, Any]]:
    """``(torch._C, name, answer)`` for each of torch's C accelerator hooks named in ``answers``
    (``_get_accelerator``, ``_accelerator_getDeviceIndex``, ...) that this torch has: what
    graphmem.patching.patched takes, so torch's own Python code (torch.accelerator, FSDP2's
    default mesh, ``dist.barrier``) asks them of a fake GPU."""
    return [(torch._C, name, answer) for name, answer in answers.items() if hasattr(torch._C, name)]


@contextlib.contextmanager
def per_device_caches_cleared() -> Iterator[None]:
    """torch's caches of per-device answers emptied on entry and on exit: DDP's side streams, one
    per device index (``torch.nn.parallel._functions._streams``, sized by the device count it
    first saw), and ``torch.get_device_module()``'s module for the current accelerator."""
    from torch.nn.parallel import _functions

    def clear() -> None:
        _functions._streams = None
        torch.get_device_module.cache_clear()

    clear()
    try:
        yield
    finally:
        clear()
