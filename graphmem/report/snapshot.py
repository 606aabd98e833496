"""Stage 4: PyTorch memory_viz export.  ModeReport -> a memory snapshot pickle.

Input: one ModeReport.  Output: the dictionary ``torch.cuda.memory._snapshot()`` returns
(and ``torch.cuda.memory._dump_snapshot()`` pickles), so PyTorch's own viewers open it:
https://pytorch.org/memory_viz and ``python -m torch.cuda._memory_viz trace_plot FILE``.
The format is documented in torch/cuda/memory.py (``_snapshot``) and read by
torch/cuda/_memory_viz.py and torch/utils/viz/MemoryViz.js:

  - ``device_traces[0]``: the predicted alloc/free sequence (``graphmem.memory.memory_events``)
    as ``alloc`` / ``free_requested`` / ``free_completed`` entries, storages that exist
    before the first op first, plus each op's scratch bytes (a rule's workspace) allocated
    after its outputs and freed before the next release;
  - ``segments``: one segment whose ``active_allocated`` blocks are the storages still live
    after the last op (what a snapshot taken at the end of the step holds).

Every entry's ``frames`` (innermost first) name the storage's category and the op that
made it with its index, the module path from the innermost module out to the model, and
the phase and iteration, so the viewer's stack for an allocation reads like a Python
stack through the model.  Addresses are synthetic:
each storage gets its own range, 512-byte aligned like the CUDA caching allocator's blocks
(c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize), and ranges are never reused; only the
Active Memory Timeline (sizes over time) is a prediction, the address layout is not.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from graphmem.cuda.allocator import MemoryEvent
from graphmem.memory.alloc_events import scratch_allocations, with_extra_allocations
from graphmem.memory.attribution import OPTIMIZER_STEP
from graphmem.memory.mode_report import memory_events
from graphmem.memory.results import Category, ModeReport
from graphmem.records import StorageRecord
from graphmem.report.modules import INPUTS, LOSS, ROOT, op_module, storage_module

__all__ = ["ALIGNMENT", "BASE_ADDRESS", "build_snapshot", "storage_frames", "write_snapshot"]

BASE_ADDRESS = 0x7F0000000000
ALIGNMENT = 512
Frame = dict[str, Any]


def _frame(filename: str, line: int, name: str) -> Frame:
    return {"filename": filename, "line": line, "name": name}


def storage_frames(storage: StorageRecord, category: Category, mode: ModeReport, root: str) -> list[Frame]:
    """The stack shown for a storage, innermost first: its category and the op that made it
    (``activations:48:aten.relu.default``) or its name (``parameters:0:fc.weight``), its
    modules out to the model, then the phase and iteration (``train step:1:forward``)."""
    trace = mode.trace
    module = storage_module(storage, category, trace)
    if storage.created < 0:
        return ([_frame(str(category), 0, storage.label or f"storage {storage.sid}")]
                + _module_frames(module, root) + [_frame(f"{trace.mode} step", 0, "before the step")])
    op = trace.ops[storage.created]
    named = f" -> {storage.label}" if storage.label else ""
    return ([_frame(str(category), op.index, f"{op.op}{named}")] + _module_frames(module, root)
            + [_phase_frame(mode, op.index)])


def _phase_frame(mode: ModeReport, step: int) -> Frame:
    op = mode.trace.ops[step]
    return _frame(f"{mode.trace.mode} step", op.iteration + 1, f"{op.phase} (iteration {op.iteration + 1})")


def _module_frames(module: str, root: str) -> list[Frame]:
    """One frame per module from the innermost out to the model itself."""
    if module == INPUTS:
        return [_frame("module", 0, module)]
    if module in (LOSS, OPTIMIZER_STEP, ROOT):  # a row of its own, then the model
        return [_frame("module", 0, module)] * (module != ROOT) + [_frame("module", 0, root)]
    parts = module.split(".")
    paths = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    return [_frame("module", 0, f"{root}.{p}") for p in paths] + [_frame("module", 0, root)]


def _aligned(nbytes: int) -> int:
    # every range at least one block, so even empty storages get an address of their own
    return max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)


def _sequence(mode: ModeReport) -> list[MemoryEvent]:
    """``memory_events`` with each op's scratch bytes as an alloc/free pair (sid -1 - step)
    after the op's allocations and before the releases that follow it, then the releases
    after the last op (``memory_events`` keeps those live: the step's locals, zero_grad's
    gradients), so only what the step still references stays allocated."""
    events = memory_events(mode.lifetimes, len(mode.trace.ops))
    last = len(mode.trace.ops) - 1
    released = {s.sid for s in mode.trace.storages if s.released is not None}
    freed = {e.sid for e in events if e.kind == "free"}
    final = [MemoryEvent("free", life.sid, life.nbytes, last) for life in mode.lifetimes
             if life.sid in released and life.sid not in freed and life.end >= last]
    return list(with_extra_allocations(events, scratch_allocations(mode.trace.ops))) + final


def _scratch_frames(mode: ModeReport, step: int, root: str) -> list[Frame]:
    op = mode.trace.ops[step]
    module = op_module(mode.trace, step)
    return [_frame("scratch", step, op.op)] + _module_frames(module, root) + [_phase_frame(mode, step)]


def _trace_entries(event: MemoryEvent, address: int, frames: list[Frame]) -> list[dict[str, Any]]:
    # No "category" key: MemoryViz.js then needs an "unknown" category or it fails on a typo
    # (`snapshot.categores.push('unknown')` in annotate_snapshot); frames name the category.
    base = {"addr": address, "size": event.nbytes, "stream": 0, "frames": frames}
    if event.kind == "alloc":
        return [{"action": "alloc", **base}]
    return [{"action": "free_requested", **base}, {"action": "free_completed", **base}]


def build_snapshot(mode: ModeReport, root: str = "model") -> dict[str, Any]:
    """The snapshot dictionary for ``mode`` (see the module docstring).

    Args:
        mode: the mode to export.
        root: the model's name, the outermost module frame.

    Returns:
        ``{"segments": [one segment], "device_traces": [[entries]]}``; sizes in bytes.
    """
    storages = {s.sid: s for s in mode.trace.storages}
    categories = {life.sid: life.category for life in mode.lifetimes}
    frames: dict[int, list[Frame]] = {}
    addresses: dict[int, int] = {}
    cursor = BASE_ADDRESS
    entries: list[dict[str, Any]] = []
    # one pass in event order: a fresh address range at each allocation, frames once per storage
    for event in _sequence(mode):
        if event.sid not in addresses:
            addresses[event.sid], cursor = cursor, cursor + _aligned(event.nbytes)
            frames[event.sid] = (_scratch_frames(mode, event.step, root) if event.sid < 0 else
                                 storage_frames(storages[event.sid], categories[event.sid], mode, root))
        entries += _trace_entries(event, addresses[event.sid], frames[event.sid])
    freed = {e["addr"] for e in entries if e["action"] == "free_completed"}
    live = [(e["addr"], e["size"], e["frames"]) for e in entries if e["action"] == "alloc" and e["addr"] not in freed]
    return {"segments": [_segment(live, cursor)], "device_traces": [entries]}


def _segment(live: list[tuple[int, int, list[Frame]]], end: int) -> dict[str, Any]:
    """The one segment, from BASE_ADDRESS to ``end``: its blocks tile it exactly, the live
    storages ``active_allocated`` at their addresses and the gaps ``inactive``."""
    blocks: list[dict[str, Any]] = []
    cursor = BASE_ADDRESS
    for address, size, frames in sorted(live, key=lambda item: item[0]):
        if address > cursor:
            blocks.append({"address": cursor, "size": address - cursor, "requested_size": 0,
                           "state": "inactive", "frames": []})
        blocks.append({"address": address, "size": size, "requested_size": size,
                       "state": "active_allocated", "frames": frames})
        cursor = address + size
    if end > cursor:
        blocks.append({"address": cursor, "size": end - cursor, "requested_size": 0, "state": "inactive",
                       "frames": []})
    allocated = sum(size for _, size, _ in live)
    return {"device": 0, "address": BASE_ADDRESS, "total_size": end - BASE_ADDRESS, "stream": 0,
            "segment_type": "large", "segment_pool_id": (0, 0), "allocated_size": allocated,
            "active_size": allocated, "requested_size": allocated, "blocks": blocks}


def write_snapshot(mode: ModeReport, path: str | Path, root: str = "model") -> None:
    """Pickle the snapshot of ``mode`` to ``path``, as ``torch.cuda.memory._dump_snapshot`` does."""
    with open(path, "wb") as handle:
        pickle.dump(build_snapshot(mode, root), handle, protocol=4)  # MemoryViz.js reads protocols 2-4
