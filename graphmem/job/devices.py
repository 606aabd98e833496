"""Stage 1 (and 2): the user's CUDA calls, answered on a CPU-only torch (or a CUDA build of
torch, without asking its driver: the machine need have no GPU).

Input: the analysed device (``cpu`` or ``cuda``) and the device graphmem's tensors live on
while the user's code runs (``meta`` while the model is built, the fake tensors' ``cpu``
while the step is recorded).  Output: a context manager under which model code written for
a GPU runs unchanged:

- ``tensor.cuda()``, ``module.cuda()``, ``tensor.to("cuda")`` / ``.to(0)``, and any
  ``device="cuda"`` / ``device=torch.device("cuda", i)`` / ``device=0`` given to a torch
  function (``torch.zeros(..., device="cuda")``, ``x.new_empty(..., device=...)``,
  ``with torch.device("cuda"):``) put the tensor where graphmem's tensors live;
- ``torch.cuda.is_available()`` answers whether the analysed device is ``cuda``, and
  ``device_count()`` agrees (1 or 0); ``current_device()`` is 0; ``set_device``,
  ``synchronize`` and ``empty_cache`` do nothing; the current stream captures no CUDA graph;
  ``torch.accelerator`` answers the same.  These are the one fake GPU's core answers
  (graphmem.job.fake_gpu, which graphmem run's GPU answers whole): analyze is told no GPU
  preset here, so it answers no properties or memory counters.

Without it a CPU-only torch raises "Torch not compiled with CUDA enabled" at the first of
these calls.  What is analysed does not change: the device whose memory is predicted is the
``--device`` graphmem was given, never the one the model code names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from graphmem.job.fake_gpu import FakeGpu, IdleEvent, IdleStream, answering
from graphmem.patching import patched

__all__ = ["IdleEvent", "IdleStream", "cuda_calls_on_cpu"]

_TENSOR_MOVES = (torch.Tensor.to, torch.Tensor.cuda)


def _names_cuda(value: Any) -> bool:
    """Whether ``value`` names a CUDA device: "cuda", "cuda:1", torch.device("cuda"), or an
    index (a bare int means a CUDA device to torch)."""
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.split(":", 1)[0].strip() == "cuda"
    return isinstance(value, int) and not isinstance(value, bool)


class _CudaDevicesHere(TorchFunctionMode):
    """Rewrites a CUDA device given to any torch function or tensor method to ``here``."""

    def __init__(self, here: torch.device) -> None:
        super().__init__()
        self.here = here

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:  # tensor.cuda(device=None, non_blocking=False, ...)
            return args[0].to(self.here)
        if func is torch.Tensor.to:  # .to(device), .to(device, dtype), .to(0): device is positional
            args = tuple(self.here if i and _names_cuda(a) else a for i, a in enumerate(args))
        if "device" in kwargs and _names_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": self.here}
        return func(*args, **kwargs)


def _method_answers(here: torch.device) -> dict[tuple[Any, str], Callable[..., Any]]:
    """``tensor.cuda()`` and ``tensor.to(<cuda>)`` as methods, for the recorded step, where a
    TorchFunctionMode must not be active: torch.overrides.has_torch_function() is then true
    for every tensor, and modules such as nn.TransformerEncoderLayer leave their fast path
    (other kernels, other memory) when it is."""
    to = torch.Tensor.to

    def moved(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        args = tuple(here if _names_cuda(a) else a for a in args)
        if "device" in kwargs and _names_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": here}
        return to(self, *args, **kwargs)

    return {(torch.Tensor, "cuda"): lambda self, *args, **kwargs: to(self, here), (torch.Tensor, "to"): moved}


@contextlib.contextmanager
def cuda_calls_on_cpu(target: str, *, tensors_on: str = "cpu", functions: bool = True) -> Iterator[None]:
    """Run the user's model code (construction, forward) with its CUDA calls answered.

    Args:
        target: the analysed device, ``cpu`` or ``cuda``: what ``torch.cuda.is_available()``
            and ``torch.cuda.device_count()`` report.
        tensors_on: where a tensor the code sends to CUDA goes: ``meta`` while the model is
            built, ``cpu`` (the fake tensors' device) while the step is recorded.
        functions: also rewrite ``device="cuda"`` given to any torch function (a
            TorchFunctionMode: for building the model); False: only ``tensor.cuda()`` and
            ``tensor.to(<cuda>)``, as patched methods (for the recorded step, see
            _method_answers; there the recorder moves factory ops' ``device="cuda"`` to the
            fake tensors' device, at the dispatcher).

    The answers are the one fake GPU's core (graphmem.job.fake_gpu: one device or none, device
    0 current whatever the code selects).  The patches are undone on exit, also on an
    exception; nested uses restore in order.
    """
    here = torch.device(tensors_on)
    methods = {} if functions else _method_answers(here)
    # module.cuda() would visit every tensor only to leave it where it is
    own = {(nn.Module, "cuda"): lambda self, device=None: self, **methods}
    with answering(FakeGpu(available=target == "cuda", checked=False), whole=False), \
            patched(*((owner, name, replacement) for (owner, name), replacement in own.items())), \
            _CudaDevicesHere(here) if functions else contextlib.nullcontext():
        yield
