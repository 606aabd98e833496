"""The one fake GPU, answering: every device question torch or a library can ask, from one state.

Input: a ``FakeGpu`` (graphmem.job.fake_gpu.state).  Output: ``answering(gpu)``, the context
under which ``torch.cuda``, ``torch.accelerator``, torch's C accelerator hooks, ``torch.Stream``
and ``torch.Event`` (and, with ``whole``, ``torch.device(1)``) answer from it; and
``gpus_on_the_node(n)``, under which the answering GPU's node has ``n`` devices (a rank of a
torchrun job: graphmem.trace.program.ranks).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch

from graphmem._torch_api import accelerator_hooks, per_device_caches_cleared
from graphmem.job.fake_gpu.accelerator import accelerator_answers, hook_answers
from graphmem.job.fake_gpu.cuda import cuda_answers, cuda_modules
from graphmem.job.fake_gpu.int_devices import int_devices
from graphmem.job.fake_gpu.state import FakeGpu, IdleEvent, IdleStream, active_gpu
from graphmem.patching import patched

__all__ = ["answering", "gpus_on_the_node", "import_dynamo_first"]


def import_dynamo_first() -> None:
    """torch._dynamo, when first imported, builds a table of torch functions found by name
    (torch.cuda.is_available among them; trace_rules.get_torch_obj_rule_map): imported while
    they are answered, it would keep the answers.  The user's code imports it lazily (a meta
    tensor's ``normal_`` runs torch._refs, which does), so import it before answering; every
    analysis imports it anyway."""
    with contextlib.suppress(ImportError):
        importlib.import_module("torch._dynamo")


def _patches(gpu: FakeGpu, whole: bool) -> list[tuple[Any, str, Any]]:
    cuda = cuda_answers(gpu, whole=whole)
    accelerator = accelerator_answers(gpu, cuda, whole=whole)
    patches = [*((torch.cuda, name, value) for name, value in cuda.items()),
               *((torch.accelerator, name, value) for name, value in accelerator.items()
                 if hasattr(torch.accelerator, name))]
    if whole:
        patches += [*cuda_modules(), *accelerator_hooks(hook_answers(gpu, cuda)),
                    (torch, "Stream", IdleStream), (torch, "Event", IdleEvent)]
    return patches


@contextlib.contextmanager
def answering(gpu: FakeGpu, *, whole: bool = True) -> Iterator[None]:
    """Inside, every device question answers from ``gpu``: ``whole`` (graphmem run) every public
    function of ``torch.cuda`` and ``torch.accelerator`` (graphmem.job.fake_gpu.cuda's tables),
    torch's C accelerator hooks, ``torch.Stream``/``torch.Event`` and ``torch.device(1)``; else
    (analyze) the core: whether there is a GPU, how many, which is current, its streams.
    Undone on exit, an exception too; nested uses restore in order."""
    import_dynamo_first()
    gpu.push()
    try:
        with patched(*_patches(gpu, whole)), per_device_caches_cleared() if whole else contextlib.nullcontext(), \
                int_devices() if whole else contextlib.nullcontext():
            yield
    finally:
        gpu.pop()


@contextlib.contextmanager
def gpus_on_the_node(count: int) -> Iterator[None]:
    """Inside, the answering fake GPU's node has ``count`` devices (``torch.cuda.device_count()``,
    ``torch.accelerator.device_count()``, the valid indices); no fake GPU answering: nothing."""
    gpu = active_gpu()
    if gpu is None:
        yield
        return
    before = gpu.count
    gpu.count = count
    try:
        yield
    finally:
        gpu.count = before
