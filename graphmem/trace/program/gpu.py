"""``graphmem run --gpu``: the program's "cuda" is the target GPU, recorded on fake CPU tensors.

Input: the recorder and a ``GpuTarget`` (the GPU as ``torch.cuda`` describes it, CUDA's kernel
choices, and the allocator model's counters for the run so far, a function the caller gives).
Output: ``on_the_gpu``, a context manager under which a program written for a GPU runs
unchanged on a CPU-only torch, and the recorder knows which storages are the GPU's.

- **Where each tensor lives.**  A tensor made on the GPU (``device="cuda"``, ``with
  torch.device("cuda")``), moved to it (``.to("cuda")``, ``.cuda()``, ``module.to(device)``)
  or computed from such tensors is the GPU's; anything else (the data the program loads, a
  ``.cpu()`` copy) is the host's and weighs nothing in the GPU's memory (the recorder's
  ``on_gpu``).  The program's code sees its GPU tensors on ``cuda:0`` (``.device``,
  ``.is_cuda``), so ``torch.arange(n, device=x.device)`` is made on the GPU as on a real one;
  torch's kernels see the CPU fakes they run on.
- **What ``torch.cuda`` answers**: available, one device, the GPU's name, capability,
  properties and memory; ``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
  ``max_memory_reserved`` and ``memory_stats`` from the caching allocator model over the run
  up to that call (so a program that logs its memory prints graphmem's prediction);
  ``reset_peak_memory_stats`` starts the peaks again; streams, events and ``synchronize``
  are accepted and do nothing; ``torch.accelerator`` answers the same.
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
    fake_mode_without_cuda,
    fakes_show_device,
    parse_to,
    tree_flatten,
)
from graphmem.errors import UnsupportedError
from graphmem.job.devices import IdleEvent, IdleStream
from graphmem.patching import patched
from graphmem.records import Trace
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.cuda_target.autocast import cuda_autocast
from graphmem.trace.cuda_target.kernels import CudaKernels

__all__ = ["GpuMemory", "GpuTarget", "on_the_gpu"]

_CUDA = torch.device("cuda", 0)
_CPU = torch.device("cpu")
_COPY = torch.ops.aten._to_copy.default
_NCCL_VERSION = (2, 21, 5)  # what torch.cuda.nccl.version() answers: a recent NCCL (programs check minimums)


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """``torch.cuda``'s memory counters at one moment of the run, in bytes (peaks since the
    last ``reset_peak_memory_stats``)."""

    allocated: int
    reserved: int
    max_allocated: int
    max_reserved: int


@dataclass(frozen=True)
class GpuTarget:
    """The GPU a program's "cuda" is.  ``memory(trace, since)``: the counters after the last op
    of ``trace`` (the run so far), peaks counted from op ``since`` on."""

    product: str  # torch.cuda.get_device_name()
    total_memory: int  # get_device_properties().total_memory
    capability: tuple[int, int]
    kernels: CudaKernels
    memory: Callable[[Trace, int], GpuMemory] = field(repr=False)


@dataclass(frozen=True)
class _Properties:
    """What ``torch.cuda.get_device_properties`` answers (the fields programs read)."""

    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int = 132
    is_integrated: bool = False
    is_multi_gpu_board: bool = False


def _no_cuda_graphs(name: str) -> type:
    """``torch.cuda``'s CUDA-graph API (``name``): refused with what to do instead when called.  A
    class, not a function: a library may name it in an annotation evaluated at import
    (transformers 5.x: ``-> torch.cuda.CUDAGraph | None``), which a function cannot take part in."""
    def refuse(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedError(f"the program captures a CUDA graph (torch.cuda.{name}), which graphmem run does not "
                               "model yet: run it without CUDA graphs (torchtitan: --training.disable_cuda_graphs)")
    return type(name, (), {"__new__": refuse, "__doc__": f"torch.cuda.{name}, refused under graphmem run"})


class _OnDevice:
    """``with torch.cuda.device(i):`` / ``torch.cuda.device_of(t)``: every device is the GPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __enter__(self) -> _OnDevice:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


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

    def stats(self, device: Any = None) -> dict[str, int]:
        now = self.now()
        stats = {"num_alloc_retries": 0, "num_ooms": 0, "num_device_alloc": 0, "num_device_free": 0}
        for kind in ("allocated_bytes", "active_bytes"):
            stats |= {f"{kind}.all.current": now.allocated, f"{kind}.all.peak": now.max_allocated}
        return stats | {"reserved_bytes.all.current": now.reserved, "reserved_bytes.all.peak": now.max_reserved}


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


def _summary(now: GpuMemory) -> str:
    """``torch.cuda.memory_summary()``: the counters, in the words of torch's table."""
    rows = [("Allocated memory", now.allocated, now.max_allocated), ("GPU reserved memory", now.reserved,
                                                                      now.max_reserved)]
    return "\n".join(f"{name:<24} cur {cur:>16,} B   peak {peak:>16,} B" for name, cur, peak in rows) + "\n"


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
        return _CudaAutocast(dtype or torch.float16)

    def cuda_amp(enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> Any:
        return autocast("cuda", dtype=dtype, enabled=enabled)

    return [(torch, "autocast", autocast), (torch.amp, "autocast", autocast), (torch.cuda.amp, "autocast", cuda_amp)]


def _moves(recorder: Recorder) -> list[tuple[Any, str, Any]]:
    """``tensor.to``, ``.cuda``, ``.cpu`` between the host and the GPU: a copy (the recorder places
    it by the device asked for); within one place, as before."""
    to: Any = torch.Tensor.to
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
        copy = bool(kwargs.pop("copy", False))
        kwargs = dict(kwargs)
        if len(args) > 3 or (args and isinstance(args[0], torch.dtype) and len(args) > 2):  # (..., non_blocking, copy)
            *args, copy = args  # type: ignore[assignment]
        device, dtype, non_blocking, memory_format = parse_to(*args, **kwargs)
        if device is None:
            converted: torch.Tensor = to(self, *args, **kwargs, copy=copy)
            return converted
        gpu = device.type == "cuda"
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

    return [(torch.Tensor, "to", moved),
            (torch.Tensor, "cuda", lambda self, device=None, non_blocking=False, **kw: moved(self, "cuda",
                                                                                          non_blocking=non_blocking)),
            (torch.Tensor, "cpu", lambda self, memory_format=None: moved(self, "cpu")),
            (torch.Tensor, "pin_memory", lambda self, device=None: self),
            (torch.Tensor, "record_stream", lambda self, stream: None),
            (torch.Tensor, "get_device", lambda self: 0 if recorder.books.is_on_gpu(self) else -1),
            (nn.Module, "cuda", lambda self, device=None: self.to(_CUDA))]


class _HostAsked(TorchFunctionMode):
    """Marks the program's Python calls that ask for the CPU while they run (``device="cpu"``,
    ``torch.zeros(n, device=x.device)`` of a host ``x``, ``torch.randint(...)`` with no device:
    the default device): the recorder then places what they make on the host (see
    ``Recorder.place``).  Calls from torch's C++ code never pass here."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.backward:  # torch pops the modes for it: the backward (checkpoint's
            with self:                     # recompute in it) would run without CUDA's kernels
                return _tensor_backward(*args, **kwargs)
        device = kwargs.get("device")
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


def _program_modes(recorder: Recorder) -> AbstractContextManager[None]:
    """The program's own dispatch modes (activation checkpointing's, a flop counter) see each op
    as a GPU shows it: a ``device`` argument that torch's C++ code took from a GPU tensor's
    options (``type_as``, ``x.new_empty``, a composite's ``input.options()``) is ``cuda:0``, as in
    a real run, not the CPU the fakes live on.  torchtitan's selective checkpointing saves every
    ``_to_copy`` to the CPU (a device-to-host copy it will not redo): without this it would save
    each norm's and RoPE's ``type_as`` cast in every block.  The CPU stays the CPU where the
    program's Python code asked for it (``.cpu()``, ``device="cpu"``) or the op reads only host
    tensors.  torch's own infrastructure modes (fake, functional, proxy) and graphmem's are left
    as they are; the recorder turns ``cuda:0`` back into the fakes' device below them."""
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
                    kwargs = {**kwargs, "device": _CUDA}
            return dispatch(func, types, args, kwargs)

        # the dispatcher looks it up on the mode itself, and takes only a method
        mode.__torch_dispatch__ = MethodType(as_on_the_gpu, mode)

    return dispatch_modes_pushed(shown_on_the_gpu)


def _answers(gpu: GpuTarget, counters: _Counters) -> list[tuple[Any, str, Any]]:
    """``torch.cuda``'s functions as the target GPU answers them."""
    props = _Properties(gpu.product, gpu.total_memory, *gpu.capability)
    answers: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: 1, "current_device": lambda: 0, "set_device": lambda device: None,
        "synchronize": lambda device=None: None, "empty_cache": lambda: None, "ipc_collect": lambda: None,
        "get_device_name": lambda device=None: gpu.product,
        "get_device_capability": lambda device=None: gpu.capability,
        "get_device_properties": lambda device=None: props,
        "is_bf16_supported": lambda including_emulation=True: gpu.capability >= (8, 0),
        "mem_get_info": lambda device=None: (max(gpu.total_memory - counters.now().reserved, 0), gpu.total_memory),
        "memory_allocated": lambda device=None: counters.now().allocated,
        "max_memory_allocated": lambda device=None: counters.now().max_allocated,
        "memory_reserved": lambda device=None: counters.now().reserved,
        "max_memory_reserved": lambda device=None: counters.now().max_reserved,
        "memory_stats": counters.stats,
        "reset_peak_memory_stats": counters.reset, "reset_max_memory_allocated": counters.reset,
        "reset_accumulated_memory_stats": lambda device=None: None,
        "set_per_process_memory_fraction": lambda fraction, device=None: None,
        "Stream": IdleStream, "Event": IdleEvent, "current_stream": lambda device=None: IdleStream(),
        "device": _OnDevice, "device_of": _OnDevice,
        **_generator_answers(),
        "memory_summary": lambda device=None, abbreviated=False: _summary(counters.now()),
        "default_stream": lambda device=None: IdleStream(), "stream": lambda stream=None: stream or IdleStream(),
        **{name: _no_cuda_graphs(name) for name in ("graph_pool_handle", "CUDAGraph", "graph",
                                                    "make_graphed_callables")},
    }
    # torch.accelerator (accelerate and transformers ask it which device there is): the same GPU
    accelerator: dict[str, Any] = {
        "is_available": lambda: True, "current_accelerator": lambda check_available=False: torch.device("cuda"),
        "device_count": lambda: 1, "current_device_index": lambda: 0, "current_device_idx": lambda: 0,
        "set_device_index": lambda device: None, "set_device_idx": lambda device: None,
        "synchronize": lambda device=None: None, "current_stream": lambda device=None: IdleStream(),
        "empty_cache": lambda: None, "get_memory_info": answers["mem_get_info"],
        **{name: answers[name] for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                                            "max_memory_reserved", "memory_stats", "reset_peak_memory_stats",
                                            "reset_accumulated_memory_stats")},
    }
    import torch.cuda.nccl as nccl
    import torch.cuda.nvtx as nvtx  # profiler ranges: marks on nothing
    import torch.distributed as dist

    ranges = {"range_push": lambda msg: 0, "range_pop": lambda: 0, "range_start": lambda msg: 0,
              "range_end": lambda handle: None, "mark": lambda msg: None, "range": _OnDevice}
    # a CUDA build of torch has NCCL (torchtune checks it, and its version, before it takes bf16)
    communication = [(nccl, "version", lambda: _NCCL_VERSION), (nccl, "is_available", lambda tensors: True),
                     *([(dist, "is_nccl_available", lambda: True)] if dist.is_available() else [])]
    return [*((torch.cuda, name, value) for name, value in answers.items()), *communication,
            *((nvtx, name, value) for name, value in ranges.items()),
            *((torch.accelerator, name, value) for name, value in accelerator.items()
              if hasattr(torch.accelerator, name))]


def _generator_answers() -> dict[str, Callable[..., Any]]:
    """Every function of torch.cuda's generator (torch.cuda.random): its state is CUDA's 16
    bytes on the host (activation checkpointing saves and restores it), it started at 0, and
    setting or starting it does nothing."""
    import torch.cuda.random as generator

    def state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(16, dtype=torch.uint8)

    answers: dict[str, Callable[..., Any]] = {}
    for name in generator.__all__:
        if name.startswith("get_"):
            answers[name] = (lambda *a, **k: [state()]) if name.endswith("_all") else state
        elif name.startswith("initial_"):
            answers[name] = lambda *a, **k: 0
        else:
            answers[name] = lambda *a, **k: None
    return answers


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


@contextlib.contextmanager
def on_the_gpu(recorder: Recorder, gpu: GpuTarget, snapshot: Callable[[int], tuple[Trace, int]]) -> Iterator[None]:
    """Run the program (inside) with its "cuda" the target GPU; ``snapshot(i)`` is the run so far
    and where the recorder's op ``i`` is in it.

    Enter it outside the fake mode and the recorder: the GPU's kernels (a TorchFunctionMode)
    are entered here, the dispatch modes after it."""
    _import_before_the_gpu_is_there()
    recorder.books.on_gpu = set()
    gpu.kernels.position = lambda: len(recorder.ops)
    counters = _Counters(recorder, gpu, snapshot)
    shown = lambda t: recorder.dispatching == 0 and recorder.books.is_on_gpu(t)
    with fake_mode_without_cuda(), patched(*_answers(gpu, counters), *_moves(recorder), *_autocasts()), \
            _program_modes(recorder), fakes_show_device(_CUDA, shown), gpu.kernels, _HostAsked(recorder):
        yield
