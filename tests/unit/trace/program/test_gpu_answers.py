"""The one fake GPU (graphmem.job.fake_gpu), as graphmem run sets it up for rank 1 of a 2-GPU
node after ``torch.cuda.set_device(1)``: every public callable of ``torch.cuda`` and
``torch.accelerator`` (walked with dir(): a name torch adds must be put in a table here) either
answers as that GPU, as this file's table says, or raises one UnsupportedError; torch's C
accelerator hooks, ``torch.device(1)``, ``torch.Stream`` and DDP's per-device streams agree."""

from __future__ import annotations

import copy
import pickle
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from graphmem.errors import UnsupportedError
from graphmem.job.fake_gpu import FakeGpu, GpuMemory, GpuProperties, answering, gpus_on_the_node

GIB = 2**30
H100 = GpuProperties("NVIDIA H100 80GB HBM3", 80 * GIB, 9, 0)
NOW = GpuMemory(allocated=1000, reserved=2048, max_allocated=1500, max_reserved=4096)
REFUSED = "refused"  # raises graphmem's UnsupportedError
KEPT = "kept"  # torch's own object: an exception type a program catches, a table of constants


def _public(module: types.ModuleType) -> set[str]:
    """What a program can call: the module's public names (``__all__``) and the exception types it
    exposes; not the typing and functools helpers it imports."""
    names = set()
    for name in dir(module):
        value = getattr(module, name)
        if name.startswith("_") or isinstance(value, types.ModuleType) or not callable(value):
            continue
        if name in module.__all__ or (isinstance(value, type) and issubclass(value, BaseException)):
            names.add(name)
    return names


def returns(expected: Any, *args: Any) -> Callable[[Callable[..., Any]], None]:
    def check(fn: Callable[..., Any]) -> None:
        assert fn(*args) == expected
    return check


def on_device(index: int) -> Callable[[Any], None]:
    """A stream on ``cuda:index``."""
    def check(stream: Any) -> None:
        assert stream.device == torch.device("cuda", index) and not stream.is_capturing() and stream.query()
    return check


def stream_made(*args: Any, index: int = 1) -> Callable[[Callable[..., Any]], None]:
    return lambda fn: on_device(index)(fn(*args))


def selects(*args: Any, inside: int) -> Callable[[Callable[..., Any]], None]:
    """A context selecting device ``inside``; the rank's device 1 again after."""
    def check(fn: Callable[..., Any]) -> None:
        with fn(*args):
            assert torch.cuda.current_device() == inside == torch.accelerator.current_device_index()
        assert torch.cuda.current_device() == 1
    return check


def sets_device(fn: Callable[..., Any]) -> None:
    fn(0)
    assert torch.cuda.current_device() == 0 == torch.accelerator.current_device_index()
    fn(1)
    assert torch.cuda.current_device() == 1


def stream_current(fn: Callable[..., Any]) -> None:
    side = torch.cuda.Stream()
    result = fn(side)
    if result is not None:  # a context
        with result:
            assert torch.cuda.current_stream() is side
    else:
        assert torch.cuda.current_stream() is side and torch.accelerator.current_stream() is side


def allocator_enabled(fn: Callable[..., Any]) -> None:
    assert fn(True) is None
    with pytest.raises(UnsupportedError, match="caching allocator"):
        fn(False)


def fraction(fn: Callable[..., Any]) -> None:
    fn(0.5)
    assert torch.cuda.get_per_process_memory_fraction() == 0.5


def rng_state(fn: Callable[..., Any]) -> None:
    state = fn()
    assert state.dtype == torch.uint8 and state.shape == (16,) and state.device.type == "cpu"


def resets(fn: Callable[..., Any]) -> None:
    before = len(RESETS)
    assert fn() is None and len(RESETS) == before + 1


RESETS: list[int] = []
HOST_STATS = {f"{kind}.{what}": 0 for kind in ("allocations", "allocated_bytes", "active_requests", "active_bytes")
              for what in ("current", "peak", "allocated", "freed")} | {"num_host_alloc": 0, "num_host_free": 0}
LEGACY = [f"{kind}{what}" for kind in ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long",
                                       "Short") for what in ("Tensor", "Storage")] + ["ComplexDoubleStorage",
                                                                                      "ComplexFloatStorage"]

# torch.cuda: what rank 1 of a 2-GPU H100 node sees after torch.cuda.set_device(1)
CUDA: dict[str, Any] = {
    **dict.fromkeys(LEGACY, REFUSED),
    **dict.fromkeys(["CUDAGraph", "graph", "graph_pool_handle", "make_graphed_callables"], REFUSED),
    **dict.fromkeys(["utilization", "temperature", "power_draw", "clock_rate", "memory_usage"], REFUSED),
    **dict.fromkeys(["CUDAPluggableAllocator", "caching_allocator_alloc", "caching_allocator_delete",
                     "caching_allocator_disabled", "change_current_allocator", "MemPool", "use_mem_pool",
                     "GreenContext", "memory_snapshot", "current_blas_handle", "current_solver_handle"], REFUSED),
    **dict.fromkeys(["AcceleratorError", "CudaError", "DeferredCudaCallError", "OutOfMemoryError", "cudaStatus"],
                    KEPT),
    "is_available": returns(True), "is_initialized": returns(True), "init": returns(None),
    "device_count": returns(2), "current_device": returns(1), "set_device": sets_device,
    "device": selects(0, inside=0), "device_of": selects(torch.zeros(1), inside=1),
    "get_device_name": returns(H100.name), "get_device_capability": returns((9, 0)),
    "get_device_properties": lambda fn: (fn().total_memory, fn(1).major) == (80 * GIB, 9) or pytest.fail(),
    "get_arch_list": lambda fn: "sm_90" in fn() or pytest.fail(),
    "get_gencode_flags": lambda fn: "-gencode compute=compute_90,code=sm_90" in fn() or pytest.fail(),
    "is_bf16_supported": returns(True), "is_tf32_supported": returns(True),
    "can_device_access_peer": returns(True, 0, 1),
    "mem_get_info": returns((80 * GIB - 2048, 80 * GIB)),
    "memory_allocated": returns(1000), "max_memory_allocated": returns(1500),
    "memory_reserved": returns(2048), "max_memory_reserved": returns(4096),
    "memory_cached": returns(2048), "max_memory_cached": returns(4096), "device_memory_used": returns(2048),
    "memory_stats": lambda fn: (fn()["allocated_bytes.all.current"], fn()["reserved_bytes.all.peak"]) == (1000, 4096)
    or pytest.fail(),
    "memory_stats_as_nested_dict": lambda fn: fn()["allocated_bytes"]["all"]["peak"] == 1500 or pytest.fail(),
    "memory_summary": lambda fn: "1,500" in fn() and "4,096" in fn() or pytest.fail(),
    "list_gpu_processes": returns("GPU:1\nno processes are running"),
    "reset_peak_memory_stats": resets, "reset_max_memory_allocated": resets, "reset_max_memory_cached": resets,
    "reset_accumulated_memory_stats": returns(None), "empty_cache": returns(None), "ipc_collect": returns(None),
    "set_per_process_memory_fraction": fraction, "get_per_process_memory_fraction": returns(1.0),
    "host_memory_stats": returns(HOST_STATS),
    "host_memory_stats_as_nested_dict": lambda fn: fn()["allocated_bytes"]["peak"] == 0 or pytest.fail(),
    "reset_accumulated_host_memory_stats": returns(None), "reset_peak_host_memory_stats": returns(None),
    "caching_allocator_enable": allocator_enabled, "get_allocator_backend": returns("native"),
    "synchronize": returns(None), "Stream": stream_made(), "ExternalStream": stream_made(0),
    "get_stream_from_external": stream_made(0), "current_stream": stream_made(),
    "default_stream": lambda fn: on_device(1)(fn()) or fn() == fn() or pytest.fail(),
    "Event": lambda fn: fn(enable_timing=True).elapsed_time(fn()) == 0.0 or pytest.fail(),
    "StreamContext": stream_current, "stream": stream_current, "set_stream": stream_current,
    "is_current_stream_capturing": returns(False),
    "get_sync_debug_mode": returns(0), "set_sync_debug_mode": returns(None, 0), "check_error": returns(None, 0),
    "cudart": lambda fn: fn().cudaProfilerStart() == 0 or pytest.fail(),
    "get_rng_state": rng_state, "get_rng_state_all": lambda fn: len(fn()) == 2 or pytest.fail(),
    "set_rng_state": returns(None, torch.zeros(16, dtype=torch.uint8)),
    "set_rng_state_all": returns(None, [torch.zeros(16, dtype=torch.uint8)] * 2),
    "manual_seed": returns(None, 0), "manual_seed_all": returns(None, 0), "seed": returns(None),
    "seed_all": returns(None), "initial_seed": returns(0),
}

ACCELERATOR: dict[str, Any] = {
    "Graph": REFUSED,
    "is_available": returns(True), "current_accelerator": returns(torch.device("cuda"), True),
    "device_count": returns(2), "current_device_index": returns(1), "current_device_idx": returns(1),
    "set_device_index": sets_device, "set_device_idx": sets_device, "device_index": selects(0, inside=0),
    "current_stream": stream_made(), "set_stream": stream_current, "synchronize": returns(None),
    "empty_cache": returns(None), "empty_host_cache": returns(None),
    "get_device_capability": lambda fn: {torch.bfloat16, torch.float32} <= fn()["supported_dtypes"] or pytest.fail(),
    "get_memory_info": returns((80 * GIB - 2048, 80 * GIB)),
    "memory_allocated": returns(1000), "max_memory_allocated": returns(1500),
    "memory_reserved": returns(2048), "max_memory_reserved": returns(4096),
    "memory_stats": lambda fn: fn()["allocated_bytes.all.peak"] == 1500 or pytest.fail(),
    "reset_peak_memory_stats": resets, "reset_accumulated_memory_stats": returns(None),
}


@pytest.fixture
def rank_one() -> Iterator[FakeGpu]:
    """graphmem run's GPU for rank 1 of 2: the node's two devices, device 1 selected."""
    gpu = FakeGpu(properties=H100, memory=lambda: NOW, reset_peaks=lambda: RESETS.append(1))
    with answering(gpu), gpus_on_the_node(2):
        torch.cuda.set_device(1)
        yield gpu


def test_every_public_name_is_in_the_table() -> None:
    assert sorted(_public(torch.cuda)) == sorted(CUDA)
    assert sorted(_public(torch.accelerator)) == sorted(ACCELERATOR)


@pytest.mark.parametrize(("module", "name"), [*(("cuda", n) for n in sorted(CUDA)),
                                              *(("accelerator", n) for n in sorted(ACCELERATOR))])
@pytest.mark.usefixtures("rank_one")
def test_each_name_answers_as_the_ranks_gpu_or_is_refused(module: str, name: str) -> None:
    owner = getattr(torch, module)
    expected = (CUDA if module == "cuda" else ACCELERATOR)[name]
    fn = getattr(owner, name)
    if expected == KEPT:
        assert isinstance(fn, type) and fn.__module__.startswith("torch")
    elif expected == REFUSED:
        with pytest.raises(UnsupportedError, match=f"torch.{module}.{name}"):
            fn()
    else:
        expected(fn)


@pytest.mark.usefixtures("rank_one")
def test_torchs_own_questions_answer_from_the_same_gpu() -> None:
    """torch._C's accelerator hooks (FSDP2's default mesh, torch.get_device_module, DeviceMesh),
    torch.Stream with an int device and DDP's side streams (one per device of the node)."""
    from torch.nn.parallel._functions import _get_stream

    assert torch._C._get_accelerator() == torch.device("cuda")
    assert torch.get_device_module() is torch.cuda
    assert torch._C._accelerator_hooks_device_count() == 2 == torch.accelerator.device_count()
    assert torch._C._accelerator_getDeviceIndex() == 1 == torch._C._accelerator_hooks_get_current_device()
    assert torch.Stream(0).device == torch.device("cuda", 0) and isinstance(torch.Stream(), torch.Stream)
    assert _get_stream(torch.device("cuda", 1)) is _get_stream(torch.device("cuda", 1))
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.set_device(2)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.get_device_name(5)


@pytest.mark.usefixtures("rank_one")
def test_an_int_is_the_gpus_index() -> None:
    """torch.device(1) is cuda:1, as on a GPU machine; torch's devices stay torch's type
    (isinstance, pickle, deepcopy, a device context)."""
    assert torch.device(1) == torch.device("cuda", 1) == torch.device("cuda:1")
    assert isinstance(torch.device("cpu"), torch.device) and issubclass(type(torch.device("cpu")), torch.device)
    assert pickle.loads(pickle.dumps(torch.device(1))) == torch.device("cuda", 1)
    assert copy.deepcopy({"at": torch.device("cpu")}) == {"at": torch.device("cpu")}
    with torch.device("meta"):
        assert torch.empty(2).device.type == "meta"


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_selects_its_own_device(rank: int) -> None:
    """set_device(local_rank) then current_device() is local_rank, whichever API asks."""
    with answering(FakeGpu(properties=H100)), gpus_on_the_node(2):
        assert torch.cuda.current_device() == 0
        torch.accelerator.set_device_index(rank)
        assert torch.cuda.current_device() == rank == torch.accelerator.current_device_index()
        assert torch.cuda.current_stream().device == torch.device("cuda", rank)
    assert torch.device is type(torch.device("cpu"))  # put back
    assert not torch.cuda.is_available() and torch.accelerator.device_count() == 0
