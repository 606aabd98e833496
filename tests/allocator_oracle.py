"""A second ground truth: every allocation and free of the CPU allocator, as torch's profiler
records them, for code that allocates without passing through a TorchDispatchMode.

tests/oracles.py counts live storages from a TorchDispatchMode: it sees every aten op, but not
the buffers torch.compile's generated code allocates (inductor's wrapper calls the CPU
allocator directly, and its C++ kernels run outside the dispatcher).  torch's profiler with
``profile_memory=True`` records each allocation and each free of the CPU allocator with its
own timestamp and signed size (its raw allocation events: the per-op memory columns repeat
their children's bytes and lose the order inside an op, so they are not used).  Summed in
time order from the bytes already live when it starts (the model's parameters and buffers,
the inputs: the storages present, counted once each), they give the live bytes after every
allocation, and the peak.

The step run is tests/oracles.py's ``measure_training``'s (out, loss, backward, optimizer
step, zero_grad(set_to_none=True), per iteration, locals dying at return), here optionally
with the model (or the whole step function) compiled.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_flatten

from tests.oracles import Measured, _Stop, count_optimizer_steps


def storage_bytes(tensors: Sequence[Any]) -> int:
    """Bytes of the distinct storages of ``tensors`` (views and tied weights once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


_MARK = "allocator_oracle:"


def allocation_events(prof: profile) -> tuple[list[tuple[int, int]], list[tuple[int, str]]]:
    """(time in ns, signed bytes) of each CPU allocation (+) and free (-), in time order, and
    (time, phase) of each ``AllocatorCount.mark``."""
    out, marks, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            out.append((event.start_time_ns, event.extra_fields.alloc_size))
        elif event.name.startswith(_MARK):
            marks.append((event.start_time_ns, event.name.removeprefix(_MARK)))
        stack.extend(event.children)
    return sorted(out), sorted(marks)


@dataclass
class AllocatorCount:
    """Inside ``counting()``, ``mark(phase)`` names the phase of the allocations after it."""

    baseline_bytes: int

    def mark(self, phase: str) -> None:
        with torch.profiler.record_function(_MARK + phase):
            pass

    def measured(self, events: list[tuple[int, int]], marks: list[tuple[int, str]]) -> Measured:
        live = peak = self.baseline_bytes
        phases: dict[str, int] = {}
        k, phase = 0, "setup"
        for when, size in events:
            while k < len(marks) and marks[k][0] <= when:
                phase, k = marks[k][1], k + 1
            live += size
            peak = max(peak, live)
            phases[phase] = max(phases.get(phase, 0), live)
        return Measured(peak, phases)


@contextlib.contextmanager
def counting(held: Sequence[Any] = ()) -> Iterator[tuple[AllocatorCount, list[Measured]]]:
    """Count the CPU allocator's live bytes from ``held``'s storages; the result is appended to
    the yielded list when the block ends."""
    count, result = AllocatorCount(storage_bytes(held)), []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield count, result
    result.append(count.measured(*allocation_events(prof)))


def measure_training(build: Callable[[], torch.nn.Module], inputs: list[torch.Tensor],
                     make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                     loss: str = "cross_entropy", iterations: int = 2,
                     compile_model: Callable[[torch.nn.Module], Callable[..., Any]] | None = None,
                     warmup: int = 0) -> Measured:
    """tests/oracles.py's training step counted by the allocator.  ``compile_model``: what the
    model is called through (``torch.compile``); ``warmup`` steps run before counting (the
    compile's own allocations then stay out of the count)."""
    torch.manual_seed(0)
    model = build()
    model.train()
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    call = compile_model(model) if compile_model else model
    targets = torch.zeros(inputs[0].shape, dtype=torch.int64)

    def step(count: AllocatorCount | None) -> None:
        if count:
            count.mark("forward")
        out = call(*inputs)
        value = _loss(out, loss, targets)
        if count:
            count.mark("backward")
        value.backward()
        if count:
            count.mark("optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step(None)
    held = [*model.parameters(), *model.buffers(), *inputs, targets, *_state(opt)]
    with counting(held) as (count, result):
        for _ in range(iterations):
            step(count)
    return result[0]


def measure_program(script: str, argv: Sequence[str] = (), steps: int = 2) -> Measured:
    """tests/oracles.py's ``measure_program`` counted by the allocator: ``python SCRIPT ARGV``
    from its first line to the end of its ``steps``-th optimizer step."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        with counting() as (count, result):
            count.mark("step 1")
            handles = count_optimizer_steps(lambda done: _after(count, done, steps))
            try:
                with contextlib.suppress(_Stop):
                    runpy.run_path(script, run_name="__main__")
            finally:
                for handle in handles:
                    handle.remove()
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
    return result[0]


def _after(count: AllocatorCount, done: int, steps: int) -> None:
    if done >= steps:
        raise _Stop
    count.mark(f"step {done + 1}")


def _state(opt: torch.optim.Optimizer) -> list[Any]:
    return tree_flatten([dict(s) for s in opt.state.values()])[0]


def _loss(out: Any, loss: str, targets: torch.Tensor) -> torch.Tensor:
    logits = out if isinstance(out, torch.Tensor) else tree_flatten(out)[0][0]
    if loss == "sum":
        return logits.sum()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
