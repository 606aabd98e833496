"""``torch.cuda``'s public functions as the fake GPU answers them, name by name.

Input: a ``FakeGpu``.  Output: ``cuda_answers(gpu)``, name -> replacement for every callable
in ``torch.cuda.__all__`` (and its nvtx, nccl and random modules' functions), and
``CORE_CUDA``, the names analyze answers (it is told no GPU preset and models no counters).
A name either answers as the GPU would (``ANSWERED``) or raises one ``UnsupportedError``
saying what graphmem does not model and what to do instead (``REFUSED``); the exception
types (``OutOfMemoryError``, ``CudaError``, ...) and ``cudaStatus`` stay torch's own (``KEPT``).
tests/unit/trace/program/test_gpu_answers.py walks ``torch.cuda.__all__`` against the tables.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

from graphmem.errors import UnsupportedError
from graphmem.job.fake_gpu.state import FakeGpu, GpuMemory, IdleEvent, IdleStream, active_gpu

__all__ = ["ANSWERED", "CORE_CUDA", "KEPT", "REFUSED", "OnDevice", "cuda_answers", "cuda_modules", "refused"]

# what torch.cuda.nccl.version() answers: a recent NCCL (programs check minimums)
NCCL_VERSION = (2, 21, 5)
# torch.cuda.get_arch_list() of a CUDA 12.6 build of torch (the wheels' TORCH_CUDA_ARCH_LIST),
# and the target's own architecture where it is newer
_ARCHS = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")

_SENSORS = "reads the GPU's sensors ({name}), which graphmem run does not model"
_GRAPHS = ("captures a CUDA graph ({name}), which graphmem run does not model yet: run it without CUDA graphs "
           "(torchtitan: --training.disable_cuda_graphs)")
_ALLOCATOR = ("allocates outside PyTorch's caching allocator ({name}), which graphmem run does not model: "
              "run it with the caching allocator (PYTORCH_CUDA_ALLOC_CONF selects its settings)")
_POOLS = "allocates from a private memory pool ({name}), which graphmem run does not model: run it without one"
_LEGACY = "makes a legacy CUDA tensor type ({name}): make it with torch.empty(..., device='cuda', dtype=...) instead"

# name -> what graphmem says when the program calls it ("the program " + this, {name} its full name)
REFUSED: dict[str, str] = {
    **{name: _GRAPHS for name in ("CUDAGraph", "graph", "graph_pool_handle", "make_graphed_callables")},
    **{name: _SENSORS for name in ("utilization", "temperature", "power_draw", "clock_rate", "memory_usage")},
    **{name: _ALLOCATOR for name in ("caching_allocator_alloc", "caching_allocator_delete",
                                     "caching_allocator_disabled", "change_current_allocator",
                                     "CUDAPluggableAllocator")},
    **{name: _POOLS for name in ("MemPool", "use_mem_pool")},
    "GreenContext": "uses a green context ({name}: a share of the GPU's SMs), which graphmem run does not model",
    "memory_snapshot": "asks for the caching allocator's segments ({name}), which graphmem run models only as "
                       "totals: graphmem run --snapshot FILE writes the predicted snapshot",
    "current_blas_handle": "asks for a raw cuBLAS handle ({name}), which a run without a GPU has none of",
    "current_solver_handle": "asks for a raw cuSOLVER handle ({name}), which a run without a GPU has none of",
    **{f"{kind}{what}": _LEGACY for kind in ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int",
                                            "Long", "Short") for what in ("Tensor", "Storage")},
    **{f"Complex{kind}Storage": _LEGACY for kind in ("Double", "Float")},
}

# torch's own: exception types a program catches, a table of constants
KEPT = frozenset({"AcceleratorError", "CudaError", "DeferredCudaCallError", "OutOfMemoryError", "cudaStatus"})

# what analyze answers (graphmem.job.devices): whether there is a GPU, one, its streams
CORE_CUDA = frozenset({"is_available", "device_count", "current_device", "set_device", "synchronize", "empty_cache",
                       "current_stream", "default_stream", "is_current_stream_capturing"})


def refused(owner: str, name: str, why: str) -> type:
    """``owner.name`` refused when called: "the program " + ``why`` (its ``{name}`` the full name).
    A class, not a function: a library may name it in an annotation evaluated at import
    (transformers 5.x: ``-> torch.cuda.CUDAGraph | None``), or check ``isinstance`` against it
    (never true: no program has one)."""
    def refuse(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedError(f"the program {why.format(name=f'{owner}.{name}')}")
    return type(name, (), {"__new__": refuse, "__doc__": f"{owner}.{name}, refused under graphmem run"})


def _answering() -> FakeGpu:
    gpu = active_gpu()
    assert gpu is not None, "graphmem.job.fake_gpu: a device context made with no fake GPU answering"
    return gpu


class OnDevice:
    """``with torch.cuda.device(i):`` / ``torch.accelerator.device_index(i)``: ``i`` is the current
    device inside (None or a negative index: no change).  Classes, as torch's are (a program may
    check ``isinstance`` against them)."""

    def __init__(self, device: Any) -> None:
        self.gpu, self.device, self.before = _answering(), device, -1

    def __enter__(self) -> OnDevice:
        self.before = self.gpu.exchange(self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.gpu.exchange(self.before)


class OnDeviceOf(OnDevice):
    """``with torch.cuda.device_of(t):``: ``t``'s device, when it is the GPU's, is current inside."""

    def __init__(self, obj: Any) -> None:
        super().__init__(obj.device if isinstance(obj, torch.Tensor) and obj.device.type == "cuda" else None)


class StreamContext:
    """``with torch.cuda.stream(s):`` / ``torch.cuda.StreamContext(s)``: ``s`` is its device's current
    stream inside."""

    def __init__(self, stream: Any) -> None:
        self.gpu, self.stream = _answering(), stream
        self.before: IdleStream | None = None

    def __enter__(self) -> Any:
        if isinstance(self.stream, IdleStream):
            self.before = self.gpu.stream(self.stream.device_index)
            self.gpu.streams[self.stream.device_index] = self.stream
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        if isinstance(self.stream, IdleStream) and self.before is not None:
            self.gpu.streams[self.stream.device_index] = self.before


class ExternalStream(IdleStream):
    """``torch.cuda.ExternalStream(ptr)``: a stream another library made, on the current device."""

    def __init__(self, stream_ptr: int, device: Any = None) -> None:
        super().__init__(device)


def _stats(now: GpuMemory) -> dict[str, int]:
    """``torch.cuda.memory_stats()``: the counters under torch's keys."""
    stats = {"num_alloc_retries": 0, "num_ooms": 0, "num_device_alloc": 0, "num_device_free": 0}
    for kind in ("allocated_bytes", "active_bytes"):
        stats |= {f"{kind}.all.current": now.allocated, f"{kind}.all.peak": now.max_allocated}
    return stats | {"reserved_bytes.all.current": now.reserved, "reserved_bytes.all.peak": now.max_reserved}


def _nested(flat: dict[str, int]) -> dict[str, Any]:
    """``memory_stats_as_nested_dict``: ``"a.b.c": v`` as ``{"a": {"b": {"c": v}}}``."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        level = nested
        for part in path:
            level = level.setdefault(part, {})
        level[last] = value
    return nested


def _summary(now: GpuMemory) -> str:
    """``torch.cuda.memory_summary()``: the counters, in the words of torch's table."""
    rows = [("Allocated memory", now.allocated, now.max_allocated), ("GPU reserved memory", now.reserved,
                                                                      now.max_reserved)]
    return "\n".join(f"{name:<24} cur {cur:>16,} B   peak {peak:>16,} B" for name, cur, peak in rows) + "\n"


def _host_stats() -> dict[str, int]:
    """``host_memory_stats()``: the pinned host allocator (pinned memory is the host's, which the
    GPU's prediction does not count): nothing allocated."""
    keys = [f"{kind}.{what}" for kind in ("allocations", "allocated_bytes", "active_requests", "active_bytes")
            for what in ("current", "peak", "allocated", "freed")]
    return collections.OrderedDict((key, 0) for key in [*keys, "num_host_alloc", "num_host_free"])


def _generator(gpu: FakeGpu) -> dict[str, Callable[..., Any]]:
    """torch.cuda's generator (torch.cuda.random): its state is CUDA's 16 bytes on the host
    (activation checkpointing saves and restores it), one per device of the node for the
    ``_all`` functions; it started at 0, and setting or initialising it does nothing."""
    import torch.cuda.random as generator

    def state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(16, dtype=torch.uint8)

    answers: dict[str, Callable[..., Any]] = {}
    for name in generator.__all__:
        if name.startswith("get_"):
            answers[name] = (lambda *a, **k: [state() for _ in range(gpu.count)]) if name.endswith("_all") else state
        elif name.startswith("initial_"):
            answers[name] = lambda *a, **k: 0
        else:
            answers[name] = lambda *a, **k: None
    return answers


def _properties(gpu: FakeGpu) -> dict[str, Callable[..., Any]]:
    """What the GPU is (the answers that need its preset)."""
    props = gpu.properties
    assert props is not None, "cuda_answers: the GPU's properties are needed for the whole table"
    capability = (props.major, props.minor)
    arch = f"sm_{props.major}{props.minor}"
    archs = [*_ARCHS, *([arch] if arch not in _ARCHS else [])]

    def checked(answer: Callable[[], Any]) -> Callable[..., Any]:
        def at(device: Any = None) -> Any:
            gpu.index(device)  # an index past the node's devices raises as CUDA does
            return answer()
        return at

    return {
        "get_device_name": checked(lambda: props.name), "get_device_capability": checked(lambda: capability),
        "get_device_properties": checked(lambda: props), "get_arch_list": lambda: list(archs),
        "get_gencode_flags": lambda: " ".join(f"-gencode compute=compute_{arch[3:]},code=sm_{arch[3:]}"
                                              for arch in archs),
        # torch: native bf16 from sm80; below it, emulated, which including_emulation accepts
        "is_bf16_supported": lambda including_emulation=True: props.major >= 8 or including_emulation,
        "is_tf32_supported": lambda: props.major >= 8,
        "can_device_access_peer": lambda device, peer: gpu.index(device) != gpu.index(peer),
    }


def _counters(gpu: FakeGpu) -> dict[str, Callable[..., Any]]:
    """The caching allocator's counters over the run so far (graphmem.cuda's model)."""
    now = gpu.counters

    def reset(device: Any = None) -> None:
        if gpu.reset_peaks is not None:
            gpu.reset_peaks()

    def fraction(value: float, device: Any = None) -> None:
        gpu.fraction = value

    return {
        "mem_get_info": lambda device=None: (max(gpu.total_memory() - now().reserved, 0), gpu.total_memory()),
        "memory_allocated": lambda device=None: now().allocated,
        "max_memory_allocated": lambda device=None: now().max_allocated,
        "memory_reserved": lambda device=None: now().reserved, "memory_cached": lambda device=None: now().reserved,
        "max_memory_reserved": lambda device=None: now().max_reserved,
        "max_memory_cached": lambda device=None: now().max_reserved,
        "device_memory_used": lambda device=None: now().reserved,
        "memory_stats": lambda device=None: _stats(now()),
        "memory_stats_as_nested_dict": lambda device=None: _nested(_stats(now())),
        "memory_summary": lambda device=None, abbreviated=False: _summary(now()),
        "list_gpu_processes": lambda device=None: f"GPU:{gpu.index(device)}\nno processes are running",
        "reset_peak_memory_stats": reset, "reset_max_memory_allocated": reset, "reset_max_memory_cached": reset,
        "reset_accumulated_memory_stats": lambda device=None: None,
        "set_per_process_memory_fraction": fraction,
        "get_per_process_memory_fraction": lambda device=None: gpu.fraction,
        "host_memory_stats": _host_stats,
        "host_memory_stats_as_nested_dict": lambda: _nested(_host_stats()),
        "reset_accumulated_host_memory_stats": lambda: None, "reset_peak_host_memory_stats": lambda: None,
        "caching_allocator_enable": _allocator_enabled, "get_allocator_backend": lambda: "native",
    }


def _allocator_enabled(value: bool = True) -> None:
    if not value:
        raise UnsupportedError(f"the program {_ALLOCATOR.format(name='torch.cuda.caching_allocator_enable(False)')}")


def _core(gpu: FakeGpu) -> dict[str, Callable[..., Any]]:
    """What analyze answers too: whether there is a GPU, how many, which is current, streams."""
    return {
        "is_available": lambda: gpu.available, "device_count": lambda: gpu.count,
        "current_device": lambda: gpu.current if gpu.available else 0, "set_device": gpu.select,
        "synchronize": lambda device=None: None, "empty_cache": lambda: None,
        "current_stream": gpu.stream, "default_stream": lambda device=None: IdleStream(device, stream_id=0),
        "is_current_stream_capturing": lambda: False,
    }


def _streams(gpu: FakeGpu) -> dict[str, Any]:
    """Devices, streams and events: accepted, ordering nothing."""
    def set_stream(stream: Any) -> None:
        if isinstance(stream, IdleStream):
            gpu.streams[stream.device_index] = stream

    return {
        "is_initialized": lambda: gpu.available, "init": lambda: None, "ipc_collect": lambda: None,
        "device": OnDevice, "device_of": OnDeviceOf, "Stream": IdleStream, "ExternalStream": ExternalStream,
        "get_stream_from_external": lambda data_ptr, device=None: IdleStream(device), "Event": IdleEvent,
        "StreamContext": StreamContext, "stream": lambda stream=None: StreamContext(stream), "set_stream": set_stream,
        "get_sync_debug_mode": lambda: 0, "set_sync_debug_mode": lambda debug_mode: None,
        "check_error": lambda res: None,
        # nsys's profiling range (cudaProfilerStart/Stop): marks on nothing
        "cudart": lambda: SimpleNamespace(cudaProfilerStart=lambda: 0, cudaProfilerStop=lambda: 0),
    }


def cuda_answers(gpu: FakeGpu, *, whole: bool = True) -> dict[str, Any]:
    """``torch.cuda``'s name -> what stands in for it while the program runs (each its own
    function object: torch._dynamo keys a table by them); ``whole``: every name of
    ``torch.cuda.__all__`` (graphmem run), else ``CORE_CUDA`` (analyze)."""
    if not whole:
        return _core(gpu)
    answers: dict[str, Any] = {**_core(gpu), **_streams(gpu), **_properties(gpu), **_counters(gpu), **_generator(gpu)}
    answers.update((name, refused("torch.cuda", name, why)) for name, why in REFUSED.items())
    return answers


@contextlib.contextmanager
def _range(msg: str, *args: Any, **kwargs: Any) -> Iterator[None]:
    """``torch.cuda.nvtx.range(msg)``: a profiler range (a context, or a decorator) marking nothing."""
    yield


def cuda_modules() -> list[tuple[Any, str, Any]]:
    """torch.cuda's submodules' answers: NVTX ranges mark nothing; a CUDA build of torch has NCCL
    (torchtune checks it, and its version, before it takes bf16)."""
    import torch.cuda.nccl as nccl
    import torch.cuda.nvtx as nvtx
    import torch.distributed as dist

    ranges = {"range_push": lambda msg: 0, "range_pop": lambda: 0, "range_start": lambda msg: 0,
              "range_end": lambda handle: None, "mark": lambda msg: None,
              "range": _range}
    return [(nccl, "version", lambda: NCCL_VERSION), (nccl, "is_available", lambda tensors: True),
            *([(dist, "is_nccl_available", lambda: True)] if dist.is_available() else []),
            *((nvtx, name, value) for name, value in ranges.items())]


def _answered_names() -> frozenset[str]:
    from graphmem.job.fake_gpu.state import GpuProperties

    return frozenset(name for name, value in cuda_answers(FakeGpu(properties=GpuProperties("", 0, 9, 0))).items()
                     if name not in REFUSED)


# every name cuda_answers(whole=True) answers as the GPU (the test's table walks torch.cuda.__all__ against it)
ANSWERED = _answered_names()
