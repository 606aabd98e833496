"""``graphmem run --gpu``: the program's "cuda" is the target GPU, recorded on fake CPU tensors.

Input: the recorder and a ``GpuTarget`` (the GPU as ``torch.cuda`` describes it, CUDA's kernel
choices, and the allocator model's counters for the run so far, a function the caller gives).
Output: ``on_the_gpu``, a context manager under which a program written for a GPU runs
unchanged on a CPU-only torch, and the recorder knows which storages are the GPU's.

- **Where each tensor lives.**  A tensor made on the GPU (``device="cuda"``, ``with
  torch.device("cuda")``), moved to it (``.to("cuda")``, ``.cuda()``, ``module.to(device)``)
  or computed from such tensors is the GPU's; anything else (the data the program loads, a
  ``.cpu()`` copy) is the host's and weighs nothing in the GPU's memory (the recorder's
  ``on_gpu``).  The program's code sees its GPU tensors on its own device, ``cuda:<i>``
  (``.device``, ``.is_cuda``, ``.get_device()``: the index it selected or named last), so
  ``torch.arange(n, device=x.device)`` is made on the GPU as on a real one; torch's kernels see
  the CPU fakes they run on.  An int device is the GPU's index (``.to(local_rank)``,
  ``model.to(local_rank)``, ``device=local_rank``), as torch reads it on a GPU machine.
- **Every device question** (``torch.cuda``, ``torch.accelerator``, torch's C accelerator
  hooks, ``torch.Stream``, ``torch.device(1)``) answers from one ``FakeGpu``
  (graphmem.job.fake_gpu): the node's GPUs (``nproc_per_node`` under torchrun, else 1: set by
  graphmem.trace.program.ranks), the one the rank selected, the GPU's name, capability,
  properties and memory; ``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
  ``max_memory_reserved`` and ``memory_stats`` from the caching allocator model over the run
  up to that call (so a program that logs its memory prints graphmem's prediction);
  ``reset_peak_memory_stats`` starts the peaks again; streams, events and ``synchronize``
  are accepted and do nothing; what graphmem does not model raises its UnsupportedError.
- **CUDA's kernels**: ``torch.autocast("cuda")`` (and ``torch.cuda.amp.autocast``) is CUDA's
  autocast on the fakes (graphmem.trace.cuda_target.autocast); attention and dropout take
  CUDA's kernels (graphmem.trace.cuda_target.kernels); optimizers default to their foreach
  implementation because the parameters say they are on cuda, as PyTorch picks for them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from graphmem._torch_api import (
    dispatch_modes_pushed,
    dtensor_sharding_fakes_on,
    fake_mode_without_cuda,
    fakes_shown_on,
    parse_to,
    tree_flatten,
)
from graphmem.errors import UnsupportedError
from graphmem.job.fake_gpu import FakeGpu, GpuMemory, GpuProperties, answering, as_gpu_device
from graphmem.patching import patched
from graphmem.records import Trace
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.cuda_target.autocast import cuda_autocast
from graphmem.trace.cuda_target.kernels import CudaKernels

__all__ = ["GpuMemory", "GpuTarget", "on_the_gpu"]

_CUDA = torch.device("cuda", 0)
_CPU = torch.device("cpu")
_COPY = torch.ops.aten._to_copy.default


@dataclass(frozen=True)
class GpuTarget:
    """The GPU a program's "cuda" is.  ``memory(trace, since)``: the counters after the last op
    of ``trace`` (the run so far), peaks counted from op ``since`` on."""

    product: str  # torch.cuda.get_device_name()
    total_memory: int  # get_device_properties().total_memory
    capability: tuple[int, int]
    kernels: CudaKernels
    memory: Callable[[Trace, int], GpuMemory] = field(repr=False)


class _Counters:
    """The memory answers: the allocator model over the run so far, on demand."""

    def __init__(self, recorder: Recorder, gpu: GpuTarget, snapshot: Callable[[int], tuple[Trace, int]]) -> None:
        self.recorder, self.gpu, self.snapshot = recorder, gpu, snapshot
        self.since = 0

    def now(self) -> GpuMemory:
        self.recorder.poll(everything=True)  # what the program let go of by now is free
        return self.gpu.memory(*self.snapshot(self.since))

    def reset(self, device: Any = None) -> None:
        self.since = len(self.recorder.ops)


class _CudaAutocast:
    """``torch.autocast("cuda", dtype)`` as torch's own object behaves: entered any number of
    times (nested too), or used as a decorator; each entry is CUDA's autocast on the fakes."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._open: list[AbstractContextManager[None]] = []

    def __enter__(self) -> None:
        region = cuda_autocast(self.dtype)
        region.__enter__()
        self._open.append(region)

    def __exit__(self, *exc: Any) -> None:
        self._open.pop().__exit__(*exc)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def autocast_region(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)
        return autocast_region


def _autocasts() -> list[tuple[Any, str, Any]]:
    """``torch.autocast("cuda", ...)`` and ``torch.cuda.amp.autocast(...)`` as CUDA's autocast on
    the fakes; any other device's as before."""
    original = torch.amp.autocast_mode.autocast

    def autocast(device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None) -> Any:
        if device_type != "cuda":
            return original(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        if not enabled:  # a region inside an autocast one that turns it off (a loss in float32)
            return original("cpu", enabled=False)
        if dtype == torch.float32:  # CUDA's autocast to float32 (nanoGPT's dtype='float32'): the ops
            return original("cpu", enabled=False)  # it would cast run in float32, as with it off
        return _CudaAutocast(dtype or torch.float16)

    def cuda_amp(enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> Any:
        return autocast("cuda", dtype=dtype, enabled=enabled)

    return [(torch, "autocast", autocast), (torch.amp, "autocast", autocast), (torch.cuda.amp, "autocast", cuda_amp)]


def _moves(recorder: Recorder, fake: FakeGpu) -> list[tuple[Any, str, Any]]:
    """``tensor.to``, ``.cuda``, ``.cpu`` between the host and the GPU: a copy (the recorder places
    it by the device asked for); within one place, as before.  An int device is the GPU's index
    (``.to(local_rank)``, ``model.to(local_rank)``), and a GPU device named is the one the
    program's tensors show from then on (``fake.named``)."""
    to: Any = torch.Tensor.to
    module_to: Any = nn.Module.to
    inner = [False]  # torch hands a call of the original back here, through its TorchFunctionModes

    def moved(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if inner[0]:
            same: torch.Tensor = to(self, *args, **kwargs)
            return same
        inner[0] = True
        try:
            return placed(self, *args, **kwargs)
        finally:
            inner[0] = False

    def placed(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and isinstance(args[0], torch.Tensor):  # .to(other): other's device (as it says) and dtype
            return placed(self, args[0].device, args[0].dtype, *args[1:], **kwargs)
        args, kwargs = _int_devices(args, kwargs)
        copy = bool(kwargs.pop("copy", False))
        if len(args) > 3 or (args and isinstance(args[0], torch.dtype) and len(args) > 2):  # (..., non_blocking, copy)
            *args, copy = args  # type: ignore[assignment]
        device, dtype, non_blocking, memory_format = parse_to(*args, **kwargs)
        if device is None:
            converted: torch.Tensor = to(self, *args, **kwargs, copy=copy)
            return converted
        gpu = device.type == "cuda"
        if gpu:
            fake.named(device)  # an index past the node's raises as CUDA does
        if gpu == recorder.books.is_on_gpu(self):
            here: torch.Tensor = to(self, _CPU, dtype, non_blocking=non_blocking, copy=copy,
                                    **({"memory_format": memory_format} if memory_format is not None else {}))
            return here
        recorder.host_asked += not gpu
        try:
            made: torch.Tensor = _COPY(self, dtype=dtype or self.dtype, device=_CUDA if gpu else _CPU,
                                       non_blocking=non_blocking,
                                       **({"memory_format": memory_format} if memory_format is not None else {}))
        finally:
            recorder.host_asked -= not gpu
        return made

    def module_moved(self: nn.Module, *args: Any, **kwargs: Any) -> Any:  # Module.to parses in C++ too
        args, kwargs = _int_devices(args, kwargs)
        return module_to(self, *args, **kwargs)

    def gpu(device: Any) -> torch.device:  # .cuda(device): None is the current device
        return torch.device("cuda", fake.index(as_gpu_device(device)))

    return [(torch.Tensor, "to", moved), (nn.Module, "to", module_moved),
            (torch.Tensor, "cuda", lambda self, device=None, non_blocking=False, **kw: moved(
                self, gpu(device), non_blocking=non_blocking)),
            (torch.Tensor, "cpu", lambda self, memory_format=None: moved(self, "cpu")),
            (torch.Tensor, "pin_memory", lambda self, device=None: self),
            (torch.Tensor, "record_stream", lambda self, stream: None),
            (torch.Tensor, "get_device", lambda self: fake.shown if recorder.books.is_on_gpu(self) else -1),
            (nn.Module, "cuda", lambda self, device=None: self.to(gpu(device)))]


def _int_devices(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``.to(...)``'s arguments with an int device as the GPU's (the device is the first positional
    argument or ``device=``; any later int is a flag)."""
    if args:
        args = (as_gpu_device(args[0]), *args[1:])
    if "device" in kwargs:
        kwargs = {**kwargs, "device": as_gpu_device(kwargs["device"])}
    return args, dict(kwargs)


class _HostAsked(TorchFunctionMode):
    """Marks the program's Python calls that ask for the CPU while they run (``device="cpu"``,
    ``torch.zeros(n, device=x.device)`` of a host ``x``, ``torch.randint(...)`` with no device:
    the default device): the recorder then places what they make on the host (see
    ``Recorder.place``).  Calls from torch's C++ code never pass here."""

    def __init__(self, recorder: Recorder, fake: FakeGpu) -> None:
        super().__init__()
        self.recorder, self.fake = recorder, fake

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.backward:  # torch pops the modes for it: the backward (checkpoint's
            with self:                     # recompute in it) would run without CUDA's kernels
                return _tensor_backward(*args, **kwargs)
        device = kwargs.get("device")
        if isinstance(device, int) and not isinstance(device, bool):  # device=local_rank: the GPU's index
            device = kwargs["device"] = as_gpu_device(device)
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
            self.fake.named(device)
        if device is None:  # made from nothing, on torch's default device (the CPU, unless a device context says)
            asked = not any(isinstance(t, torch.Tensor) for t in tree_flatten((args, kwargs))[0])
        else:
            asked = isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"
        self.recorder.host_asked += asked
        try:
            return func(*args, **kwargs)
        finally:
            self.recorder.host_asked -= asked


def _tensor_backward(tensor: torch.Tensor, gradient: Any = None, retain_graph: bool | None = None,
                     create_graph: bool = False, inputs: Any = None) -> None:
    """``tensor.backward(...)`` as ``torch.autograd.backward`` (graphmem run's, which keeps the
    TorchFunctionModes active now)."""
    torch.autograd.backward(tensor, gradient, retain_graph, create_graph, inputs=inputs)


def _program_modes(recorder: Recorder, fake: FakeGpu) -> AbstractContextManager[None]:
    """The program's own dispatch modes (activation checkpointing's, a flop counter) see each op
    as a GPU shows it: a ``device`` argument that torch's C++ code took from a GPU tensor's
    options (``type_as``, ``x.new_empty``, a composite's ``input.options()``) is the GPU's, as in
    a real run, not the CPU the fakes live on.  torchtitan's selective checkpointing saves every
    ``_to_copy`` to the CPU (a device-to-host copy it will not redo): without this it would save
    each norm's and RoPE's ``type_as`` cast in every block.  The CPU stays the CPU where the
    program's Python code asked for it (``.cpu()``, ``device="cpu"``) or the op reads only host
    tensors.  torch's own infrastructure modes (fake, functional, proxy) and graphmem's are left
    as they are; the recorder turns the GPU's device back into the fakes' device below them."""
    def shown_on_the_gpu(mode: Any) -> None:
        own = getattr(mode, "__dict__", None)  # a mode without one keeps torch's view of the fakes
        if own is None or "__torch_dispatch__" in own or mode.is_infra_mode() \
                or type(mode).__module__.startswith("graphmem"):
            return
        dispatch = mode.__torch_dispatch__

        def as_on_the_gpu(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            device = kwargs.get("device")
            if isinstance(device, torch.device) and device.type == "cpu" and not recorder.host_asked:
                tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
                if not tensors or any(recorder.books.is_on_gpu(t) for t in tensors):
                    kwargs = {**kwargs, "device": fake.device()}
            return dispatch(func, types, args, kwargs)

        # the dispatcher looks it up on the mode itself, and takes only a method
        mode.__torch_dispatch__ = MethodType(as_on_the_gpu, mode)

    return dispatch_modes_pushed(shown_on_the_gpu)


def _fake_gpu(gpu: GpuTarget, counters: _Counters) -> FakeGpu:
    """The GPU the program sees (graphmem.job.fake_gpu): the target's properties, the allocator
    model's counters over the run so far; one device until the rank's node says how many
    (graphmem.trace.program.ranks)."""
    properties = GpuProperties(gpu.product, gpu.total_memory, *gpu.capability)
    return FakeGpu(properties=properties, memory=counters.now, reset_peaks=counters.reset)


def _import_before_the_gpu_is_there() -> None:
    """Libraries that choose their backend at import by asking ``torch.cuda.is_available()``,
    imported before it says yes: torch._dynamo keeps the functions it finds then (graphmem.job.devices),
    bitsandbytes would load its CUDA backend, which needs a CUDA build of torch.  What they
    print as they load (bitsandbytes: a line about the Hub's offline mode) is graphmem's
    doing, not the program's: not shown."""
    for name in ("torch._dynamo", "bitsandbytes"):
        if importlib.util.find_spec(name) is not None:
            with contextlib.suppress(Exception), warnings.catch_warnings(), \
                    contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                # broad: a broken library fails in the program, as without graphmem
                warnings.simplefilter("ignore")
                importlib.import_module(name)


def _data_parallel() -> list[tuple[Any, str, Any]]:
    """``nn.DataParallel`` over the one GPU a process has (pytorch/examples' imagenet wraps its
    model so): its scatter moves each input to the GPU, as torch's Scatter does for one device
    (whose C function a CPU-only torch lacks); over several devices it is refused, saying so."""
    def scatter(self: nn.DataParallel, inputs: Any, kwargs: Any, device_ids: Any) -> Any:  # type: ignore[type-arg]
        if len(device_ids) != 1:
            raise UnsupportedError(f"nn.DataParallel over {len(device_ids)} GPUs in one process, which graphmem run "
                                   "does not model: use DistributedDataParallel (one process per GPU)")
        moved = lambda value: value.cuda() if isinstance(value, torch.Tensor) else value
        return ((tuple(moved(v) for v in inputs),), ({k: moved(v) for k, v in (kwargs or {}).items()},))

    return [(nn.DataParallel, "scatter", scatter)]


@contextlib.contextmanager
def on_the_gpu(recorder: Recorder, gpu: GpuTarget, snapshot: Callable[[int], tuple[Trace, int]]) -> Iterator[None]:
    """Run the program (inside) with its "cuda" the target GPU; ``snapshot(i)`` is the run so far
    and where the recorder's op ``i`` is in it.

    Enter it outside the fake mode and the recorder: the GPU's kernels (a TorchFunctionMode)
    are entered here, the dispatch modes after it."""
    _import_before_the_gpu_is_there()
    recorder.books.on_gpu = set()
    gpu.kernels.position = lambda: len(recorder.ops)
    fake = _fake_gpu(gpu, _Counters(recorder, gpu, snapshot))

    def shown(t: torch.Tensor) -> torch.device | None:
        return fake.device() if recorder.dispatching == 0 and recorder.books.is_on_gpu(t) else None

    with fake_mode_without_cuda(), answering(fake), \
            patched(*_moves(recorder, fake), *_autocasts(), *_data_parallel()), \
            dtensor_sharding_fakes_on(_CPU), _program_modes(recorder, fake), fakes_shown_on(shown), gpu.kernels, \
            _HostAsked(recorder, fake):
        yield
