"""The one GPU a process sees: what it is, how many the node has, which one is current.

Input: the GPU's description (``GpuProperties``, the allocator model's counters) or none
(analyze, which is told only whether the target is a GPU).  Output: ``FakeGpu``, the state
every answer of graphmem.job.fake_gpu reads (one per process: a rank's), and the idle stream
and event it gives.  Every device index of the node (``cuda:0`` .. ``cuda:N-1``) is the same
GPU, the one whose memory is predicted; the program sees its GPU tensors on the device it
chose (``set_device``, or the index it named last).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FakeGpu", "GpuMemory", "GpuProperties", "IdleEvent", "IdleStream", "active_gpu"]

_ACTIVE: list[FakeGpu] = []  # the fake GPUs answering now, innermost last (graphmem.job.fake_gpu.answering)


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """``torch.cuda``'s memory counters at one moment of the run, in bytes (peaks since the
    last ``reset_peak_memory_stats``)."""

    allocated: int
    reserved: int
    max_allocated: int
    max_reserved: int


@dataclass(frozen=True)
class GpuProperties:
    """What ``torch.cuda.get_device_properties`` answers (the fields programs read)."""

    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int = 132
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    warp_size: int = 32
    max_threads_per_multi_processor: int = 2048


def active_gpu() -> FakeGpu | None:
    """The fake GPU answering now (None outside graphmem.job.fake_gpu.answering)."""
    return _ACTIVE[-1] if _ACTIVE else None


class FakeGpu:
    """The GPU one process sees.

    ``available``: whether ``torch.cuda.is_available()`` says yes (analyze's CPU target: no);
    ``properties``: the GPU's (None where the caller is not told the preset: analyze);
    ``memory``: the caching allocator's counters over the run so far and ``reset_peaks``,
    which starts their peaks again (None: not modelled here); ``checked``: device indices are
    the node's (``count``: 1, or ``nproc_per_node`` under torchrun), an index past them raises
    as CUDA does and ``set_device`` selects; unchecked (analyze), every index is device 0.
    """

    def __init__(self, *, available: bool = True, properties: GpuProperties | None = None,
                 memory: Callable[[], GpuMemory] | None = None, reset_peaks: Callable[[], None] | None = None,
                 checked: bool = True) -> None:
        self.available, self.properties, self.checked = available, properties, checked
        self.memory, self.reset_peaks = memory, reset_peaks
        self.count = 1 if available else 0
        self.current = 0  # torch.cuda.current_device()
        self.shown = 0  # the index the program's GPU tensors show (.device, .get_device())
        self.fraction = 1.0  # set_per_process_memory_fraction: remembered, never enforced
        self.streams: dict[int, IdleStream] = {}  # the current stream of each device

    def index(self, device: Any = None) -> int:
        """The device index ``device`` names: None or ``"cuda"`` the current one, an int, ``"cuda:1"``,
        ``torch.device("cuda", 1)``; checked against the node's devices (torch's error if not).
        Unchecked (analyze): always 0, whatever it names."""
        if not self.checked:
            return 0
        if isinstance(device, str):
            device = torch.device(device) if not device.lstrip("-").isdigit() else int(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            device = device.index
        index = self.current if device is None or device == -1 else int(device)
        if not 0 <= index < max(self.count, 1):
            raise RuntimeError(f"CUDA error: invalid device ordinal (the program asked for cuda:{index}; "
                               f"the node has {self.count} GPU{'s' * (self.count != 1)}: torchrun's "
                               "--nproc-per-node, or 1)")
        return index

    def select(self, device: Any) -> None:
        """``torch.cuda.set_device(device)``: it becomes current, and the device its tensors show."""
        index = self.index(device)
        if self.checked:
            self.current = self.shown = index

    def exchange(self, device: Any) -> int:
        """``torch._C._accelerator_exchangeDevice``: select ``device`` (-1: none), return the one before."""
        before = self.current
        if device is not None and device != -1:
            self.select(device)
        return before

    def named(self, device: Any) -> None:
        """The program named a GPU device for a tensor (``.to("cuda:1")``, ``device="cuda"``):
        its tensors show that index from now on (a process uses one GPU)."""
        if self.checked:
            self.shown = self.index(device)

    def device(self) -> torch.device:
        """The device the program's GPU tensors show."""
        return torch.device("cuda", self.shown)

    def stream(self, device: Any = None) -> IdleStream:
        """The current stream of ``device``."""
        index = self.index(device)
        if index not in self.streams:
            self.streams[index] = IdleStream(index, stream_id=0)
        return self.streams[index]

    def counters(self) -> GpuMemory:
        """The memory counters now (all 0 where the memory is not modelled: nothing allocated)."""
        return self.memory() if self.memory is not None else GpuMemory(0, 0, 0, 0)

    def total_memory(self) -> int:
        return self.properties.total_memory if self.properties is not None else 0

    def push(self) -> None:
        _ACTIVE.append(self)

    def pop(self) -> None:
        assert _ACTIVE and _ACTIVE[-1] is self, "FakeGpu.pop: not the innermost fake GPU"
        _ACTIVE.pop()


_STREAM_IDS = itertools.count(1)


class IdleStream:
    """A CUDA stream (``torch.cuda.Stream``, ``torch.Stream``) that orders nothing (the recording
    runs every op in program order), waits for nothing and captures no CUDA graph.  On the
    current device unless given one; the default stream of each device is its stream 0."""

    def __init__(self, device: Any = None, priority: int = 0, *, stream_id: int | None = None,
                 **kwargs: Any) -> None:
        gpu = active_gpu()
        index = gpu.index(device) if gpu is not None else 0
        self.device = torch.device("cuda", index)
        self.device_index, self.device_type, self.priority = index, 1, priority  # 1: DeviceType.CUDA
        self.stream_id = next(_STREAM_IDS) if stream_id is None else stream_id
        self.cuda_stream = self.stream_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IdleStream) and (other.device, other.stream_id) == (self.device, self.stream_id)

    def __hash__(self) -> int:
        return hash((self.device, self.stream_id))

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
    """A CUDA event (``torch.cuda.Event``, ``torch.Event``): recorded, waited on, always complete,
    no time elapsed."""

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
