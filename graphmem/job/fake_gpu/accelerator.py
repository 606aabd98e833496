"""``torch.accelerator`` and torch's C accelerator hooks as the fake GPU answers them.

Input: a ``FakeGpu`` and its ``torch.cuda`` answers (graphmem.job.fake_gpu.cuda).  Output:
``accelerator_answers``, name -> replacement for every callable in ``torch.accelerator.__all__``
(``CORE_ACCELERATOR`` for analyze), and ``hook_answers``, the same for ``torch._C``'s
``_get_accelerator`` and ``_accelerator_*`` hooks that torch's own Python code calls (FSDP2's
and DeviceMesh's defaults, ``torch.get_device_module()``, ``dist.barrier``): each the same
answer ``torch.cuda`` gives, from the same state.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch

from graphmem.job.fake_gpu.cuda import OnDevice, refused
from graphmem.job.fake_gpu.state import FakeGpu, IdleStream

__all__ = ["ACCELERATOR_REFUSED", "CORE_ACCELERATOR", "accelerator_answers", "hook_answers"]

CORE_ACCELERATOR = frozenset({"is_available", "device_count", "current_accelerator", "current_device_index",
                              "current_device_idx", "set_device_index", "set_device_idx", "synchronize",
                              "current_stream"})
ACCELERATOR_REFUSED = {"Graph": "captures a CUDA graph ({name}), which graphmem run does not model yet: run it "
                                "without CUDA graphs"}

# what torch.accelerator.get_device_capability()["supported_dtypes"] holds on a CUDA GPU: every
# dtype a tensor can be allocated in there (the quantized and bit-packed ones are not tensors' own)
_SUPPORTED = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                        torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64,
                        torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32,
                        torch.uint64})


def _set_stream(gpu: FakeGpu) -> Callable[[Any], None]:
    def set_stream(stream: Any) -> None:
        if isinstance(stream, IdleStream):
            gpu.streams[stream.device_index] = stream
    return set_stream


def accelerator_answers(gpu: FakeGpu, cuda: dict[str, Any], *, whole: bool = True) -> dict[str, Any]:
    """``torch.accelerator``'s name -> its answer (``cuda``: torch.cuda's answers, shared);
    ``whole``: every name (graphmem run), else ``CORE_ACCELERATOR`` (analyze)."""
    device = torch.device("cuda")
    core: dict[str, Any] = {
        "is_available": lambda: gpu.available, "device_count": lambda: gpu.count,
        "current_accelerator": lambda check_available=False: device if gpu.available else None,
        "current_device_index": lambda: gpu.current, "current_device_idx": lambda: gpu.current,
        "set_device_index": gpu.select, "set_device_idx": gpu.select,
        "synchronize": lambda device=None: None, "current_stream": gpu.stream,
    }
    if not whole:
        return core
    return {
        **core, "device_index": OnDevice, "set_stream": _set_stream(gpu),
        "empty_cache": lambda: None, "empty_host_cache": lambda: None,
        "get_device_capability": lambda device=None: {"supported_dtypes": set(_SUPPORTED)},
        "get_memory_info": cuda["mem_get_info"],
        **{name: cuda[name] for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                                         "max_memory_reserved", "reset_peak_memory_stats",
                                         "reset_accumulated_memory_stats")},
        "memory_stats": lambda device=None: collections.OrderedDict(sorted(cuda["memory_stats"]().items())),
        **{name: refused("torch.accelerator", name, why) for name, why in ACCELERATOR_REFUSED.items()},
    }


def hook_answers(gpu: FakeGpu, cuda: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """``torch._C``'s accelerator hooks (name -> answer), as torch.accelerator's Python code and
    torch.distributed's call them (graphmem._torch_api.accelerator_hooks patches those this
    torch has)."""
    device = torch.device("cuda")
    return {
        "_get_accelerator": lambda check=False: device,
        "_accelerator_getAccelerator": lambda: device,
        "_accelerator_getDeviceIndex": lambda: gpu.current,
        "_accelerator_setDeviceIndex": gpu.select,
        "_accelerator_exchangeDevice": gpu.exchange, "_accelerator_maybeExchangeDevice": gpu.exchange,
        "_accelerator_hooks_device_count": lambda: gpu.count,
        "_accelerator_hooks_get_current_device": lambda: gpu.current,
        "_accelerator_hooks_set_current_device": gpu.select,
        "_accelerator_hooks_exchange_device": gpu.exchange, "_accelerator_hooks_maybe_exchange_device": gpu.exchange,
        "_accelerator_synchronizeDevice": lambda index=None: None,
        "_accelerator_getStream": gpu.stream, "_accelerator_setStream": _set_stream(gpu),
        "_accelerator_emptyCache": lambda: None, "_accelerator_emptyHostCache": lambda: None,
        "_accelerator_isAllocatorInitialized": lambda: True,
        "_accelerator_getMemoryInfo": cuda["mem_get_info"],
        "_accelerator_getDeviceStats": lambda index=None: collections.OrderedDict(
            sorted(cuda["memory_stats"]().items())),
        "_accelerator_resetPeakStats": cuda["reset_peak_memory_stats"],
        "_accelerator_resetAccumulatedStats": lambda index=None: None,
        "_accelerator_getDeviceCapability": lambda index=None: {"supported_dtypes": set(_SUPPORTED)},
    }
