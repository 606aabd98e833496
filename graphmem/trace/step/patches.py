"""Everything graphmem changes in torch and in libraries while it records, in one file to audit.

Input: the recorder.  Output: context managers that patch and restore (graphmem.patching's
``patched``, so a restore cannot be forgotten): the paths libraries take, value checks, no-op
swaps, replaced buffers, FSDP2's resizes; and two preparations, ``fresh_caches`` and
``recursion_room``.  Reviewed at each torch upgrade: each names the torch code it stands in for.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import TENSOR_CHECK, all_true, check_with, is_fake, module_buffers, storage_key, tensor_check
from graphmem.patching import patched
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.distributed import following_resizes

__all__ = ["CHECK_PASSED", "fresh_caches", "recording_patches", "recursion_room"]

# the type of what functools.lru_cache (and functools.cache) wraps a function in
_LRU_CACHED = type(functools.lru_cache(maxsize=None)(lambda: None))

CHECK_PASSED = ("the model asserts a condition on its values (torch._check_tensor_all, as transformers' "
                "torch_compilable_check calls it); taken to hold, as it does in every run that completes")


@contextlib.contextmanager
def recording_patches(recorder: Recorder) -> Iterator[None]:
    """The patches every recording of a step runs under."""
    with _not_tracing_to_libraries(), _no_op_swaps(), _checks_pass(recorder), _buffers_replaced(recorder), \
            following_resizes(recorder.books.resized):
        yield


@contextlib.contextmanager
def _buffers_replaced(recorder: Recorder) -> Iterator[None]:
    """While recording, tell ``recorder`` of each buffer the model assigns over (I-BERT's
    quantizers keep their running range so: ``self.x_min = torch.min(self.x_min, x_min)``)."""
    def hook(module: nn.Module, name: str, value: Any) -> None:
        old = module_buffers(module).get(name)
        if isinstance(old, torch.Tensor):
            recorder.books.buffer_replaced(old, value)

    handle = torch.nn.modules.module.register_module_buffer_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _checks_pass(recorder: Recorder) -> contextlib.AbstractContextManager[None]:
    """``torch._check_tensor_all_with(error, cond)`` on values no shadow knows (VITS: ``all(discriminant
    >= 0)``): the reduction runs, as in a real run; its value is taken to be true, noted once.
    ``torch.isfinite`` of such values: true everywhere (graphmem.trace.values.shadows, finite checks).
    ``format(t)`` of a one-element tensor reads its value, as a real tensor's does."""
    original, shadows = tensor_check(), recorder.answers.shadows
    isfinite, str_format = torch.isfinite, torch.Tensor.__format__

    def check(error_type: Any, cond: Any, message: Any = None) -> None:
        if isinstance(cond, torch.Tensor) and is_fake(cond) and cond.dtype == torch.bool:
            result = all_true(cond)
            if shadows.get(result) is not None:  # known: checked as torch checks it
                check_with(error_type, bool(result.item()), message)
            elif CHECK_PASSED not in recorder.assumptions:
                recorder.assumptions.append(CHECK_PASSED)
            return
        original(error_type, cond, message)

    def finite(x: Any) -> Any:  # torch.isfinite is no single op: its ops run, and its answer is known
        out = isfinite(x)
        if isinstance(x, torch.Tensor) and is_fake(x) and shadows.get(x) is None and is_fake(out):
            shadows.finite_check(out, True)
        return out

    def formatted(t: torch.Tensor, spec: str) -> str:  # f"expert_{idx}": a real 0-d tensor formats its .item()
        return format(t.item(), spec) if is_fake(t) and t.dim() == 0 else str_format(t, spec)

    return patched((torch, TENSOR_CHECK, check), (torch, "isfinite", finite), (torch.Tensor, "isfinite", finite),
                   (torch.Tensor, "__format__", formatted))


def _no_op_swaps() -> contextlib.AbstractContextManager[None]:
    """``module.to(dtype)`` in a forward, where the module already is in that dtype (transformers'
    SwitchTransformers router: ``self.classifier.to(self.dtype)``).  A real run sets
    ``param.data`` to the tensor itself; with fake parameters nn.Module swaps each parameter for
    a new one around the same storage, which fails while anything else holds it.  A swap of two
    tensors that are the same view of one storage changes nothing: it is skipped."""
    original = torch.utils.swap_tensors

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if isinstance(t1, torch.Tensor) and isinstance(t2, torch.Tensor) and t1.dtype == t2.dtype \
                and storage_key(t1)[0] == storage_key(t2)[0] and t1.shape == t2.shape \
                and t1.stride() == t2.stride() and t1.storage_offset() == t2.storage_offset():
            return
        original(t1, t2)
    return patched((torch.utils, "swap_tensors", swap))


def _not_tracing_to_libraries() -> contextlib.AbstractContextManager[None]:
    """Let libraries take the path they take in a real run.

    transformers treats a FakeTensor as "tracing" (utils/import_utils.py, is_tracing ->
    is_fake_tensor) and then, for example, always materialises the 4-D attention mask that a
    real run skips when the mask is all ones.  graphmem predicts the real run, so, while it
    records, transformers is told its tensors are not fake; the value reads this unlocks are
    answered from the declared input assumptions (graphmem.trace.values.shadows).
    """
    utils = sys.modules.get("transformers.utils.import_utils")
    if utils is None or getattr(utils, "is_fake_tensor", None) is None:
        return contextlib.nullcontext()
    return patched((utils, "is_fake_tensor", lambda x: False))


def fresh_caches(model: nn.Module) -> None:
    """Empty the ``functools.lru_cache``s of the model's code, as a fresh process starts: a
    position embedding cached by shape (SAM 3, DINOv3, MaskFormer) is then made, and counted,
    in this recording, as in a training job's first step, not handed over from the recording
    before it.  The caches searched: those on the model's classes (methods, static methods, and
    caches inside a decorator's closure, as transformers' compile_compatible_method_lru_cache
    makes) and the functions of the modules that define them."""
    seen: set[int] = set()

    def clear(value: Any, depth: int = 0) -> None:
        value = getattr(value, "__func__", value)  # staticmethod / classmethod
        if id(value) in seen or depth > 2:
            return
        seen.add(id(value))
        if isinstance(value, _LRU_CACHED):
            value.cache_clear()
        for cell in getattr(value, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # an empty cell
                if callable(cell.cell_contents):
                    clear(cell.cell_contents, depth + 1)

    modules = set()
    classes = {c for m in model.modules() for c in type(m).__mro__}
    for cls in {c for c in classes if not c.__module__.startswith(("torch", "builtins"))}:
        modules.add(cls.__module__)
        for value in vars(cls).values():
            clear(value)
    for name in modules:
        for value in list(vars(sys.modules[name]).values()) if name in sys.modules else ():
            if callable(value) and not isinstance(value, type):
                clear(value)


@contextlib.contextmanager
def recursion_room(frames: int = 20_000) -> Iterator[None]:
    """Recording adds Python frames to every module call (hooks, the modes): deeply nested
    models that run for real under the default limit of 1000 need more room here."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(max(before, frames))
    try:
        yield
    finally:
        sys.setrecursionlimit(before)
