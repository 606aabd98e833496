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
  ``torch.accelerator`` answers the same.

Without it a CPU-only torch raises "Torch not compiled with CUDA enabled" at the first of
these calls.  What is analysed does not change: the device whose memory is predicted is the
``--device`` graphmem was given, never the one the model code names.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

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


class IdleStream:
    """A CUDA stream that orders nothing (the recording runs every op in program order), waits
    for nothing and captures no CUDA graph: what graphmem's CUDA answers give as a stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cuda", 0)

    def __enter__(self) -> IdleStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def wait_stream(self, *args: Any) -> None:
        return None

    def wait_event(self, *args: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> IdleEvent:
        return event if isinstance(event, IdleEvent) else IdleEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:  # no CUDA graph is captured
        return False


class IdleEvent:
    """A CUDA event: recorded, waited on, always complete, no time elapsed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def record(self, *args: Any) -> None:
        return None

    def wait(self, *args: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _answers(target: str) -> dict[tuple[Any, str], Callable[..., Any]]:
    """(owner, attribute) -> the function that replaces it while the user's code runs (each
    its own function object: torch._dynamo keys a table by them).  ``torch.accelerator``
    answers the same: in a CUDA build of torch (on a machine with no GPU, or whatever GPU it
    has) its functions would ask the driver; torch's optimizers ask it whether a CUDA graph is
    being captured when CUDA is available."""
    on_cuda = target == "cuda"
    answers: dict[tuple[Any, str], Callable[..., Any]] = {
        (torch.cuda, "is_available"): lambda: on_cuda,
        (torch.cuda, "device_count"): lambda: 1 if on_cuda else 0,
        (torch.cuda, "current_device"): lambda: 0,
        (torch.cuda, "set_device"): lambda device: None,
        (torch.cuda, "synchronize"): lambda device=None: None,
        (torch.cuda, "empty_cache"): lambda: None,
        (torch.cuda, "current_stream"): lambda device=None: IdleStream(),
        (torch.cuda, "default_stream"): lambda device=None: IdleStream(),
        (torch.cuda, "is_current_stream_capturing"): lambda: False,
        # module.cuda() would visit every tensor only to leave it where it is
        (nn.Module, "cuda"): lambda self, device=None: self,
    }
    accelerator: dict[str, Callable[..., Any]] = {
        "is_available": lambda: on_cuda, "device_count": lambda: 1 if on_cuda else 0,
        "current_accelerator": lambda check_available=False: torch.device("cuda") if on_cuda else None,
        "current_device_index": lambda: 0, "current_device_idx": lambda: 0,
        "set_device_index": lambda device: None, "set_device_idx": lambda device: None,
        "synchronize": lambda device=None: None, "current_stream": lambda device=None: IdleStream(),
    }
    answers.update({(torch.accelerator, name): value for name, value in accelerator.items()
                    if hasattr(torch.accelerator, name)})
    return answers


def _import_dynamo_first() -> None:
    """torch._dynamo, when first imported, builds a table of torch functions found by name
    (torch.cuda.is_available among them; trace_rules.get_torch_obj_rule_map): imported while
    they are patched, it would keep the replacements.  The user's code imports it lazily (a
    meta tensor's ``normal_`` runs torch._refs, which does), so import it before patching;
    every analysis imports it anyway."""
    with contextlib.suppress(ImportError):
        importlib.import_module("torch._dynamo")


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

    The patches are undone on exit, also on an exception; nested uses restore in order.
    """
    _import_dynamo_first()
    here = torch.device(tensors_on)
    answers = _answers(target) if functions else {**_answers(target), **_method_answers(here)}
    with patched(*((owner, name, replacement) for (owner, name), replacement in answers.items())), \
            _CudaDevicesHere(here) if functions else contextlib.nullcontext():
        yield
