"""torch.compile's insides: inductor's compile with graphmem's last step, and its generated
wrapper run with its buffers on fake tensors and its kernels skipped.

Inductor's output for a graph is a Python module (its "wrapper"): a ``call(args)`` that
allocates each buffer (``empty_strided_cpu``, a C function that does not pass through the
dispatcher), views one as another (``reinterpret_tensor``), calls extern kernels (aten ops
with ``out=``) and its own compiled C++ kernels, and frees each buffer (``del buf3``) where
its last use is, reusing a dead one's memory by name (``buf7 = buf2; del buf2  # reuse``).
``replay_on_fakes`` swaps, for the duration of each call only, the allocation helpers for
``torch.empty_strided`` / ``as_strided`` on the current (fake) mode and the generated kernels
for calls that do nothing: what is allocated, reused and freed, and when, is inductor's own
code; the values are never computed (fake tensors have none).  The module itself is not
changed between calls (inductor caches it per process: a real compiled run in the same
process gets its kernels).  dynamo and inductor are imported at first use (seconds).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["compile_with_inductor", "compiles_a_module_call", "global_hooks_off", "inductor_cache_dir",
           "mode_options", "replay_on_fakes"]

# the generated module's kernels: ``name = async_compile.cpp_pybinding(...)`` (also .triton, .cpp)
_KERNEL = re.compile(r"^(\w+) = async_compile\.\w+\(", re.MULTILINE)


def _empty(size: Any, stride: Any, dtype: torch.dtype, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _reinterpret(t: torch.Tensor, size: Any, stride: Any, offset: int) -> torch.Tensor:
    return torch.as_strided(t, size, stride, offset)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


# the wrapper's helpers (torch/_inductor/codegen/wrapper.py's header), as graphmem runs them
_HELPERS: dict[str, Callable[..., Any]] = {
    "empty_strided_cpu": _empty, "empty_strided_cpu_pinned": _empty, "empty_strided": _empty,
    "reinterpret_tensor": _reinterpret, "assert_size_stride": _nothing, "assert_alignment": _nothing,
}


def replay_on_fakes(compiled: Any) -> Any:
    """``compiled`` (inductor's output for one graph), its ``call`` replaced by the replay
    described in the module docstring; refused (ValueError) where its code is not a Python
    wrapper graphmem knows (an AOT-compiled library).  A graph inductor leaves as a Python
    function (one with no op to lower: a graph break's empty side) comes back as it is: its
    ops run on the fakes as any eager code."""
    if not hasattr(compiled, "current_callable"):
        return compiled
    call = compiled.current_callable
    module = getattr(getattr(call, "__func__", call), "__globals__", None)
    source = getattr(compiled, "source_code", None)
    if not isinstance(module, dict) or not isinstance(source, str) or "empty_strided_cpu" not in module:
        raise ValueError("inductor's generated code is not a Python wrapper")
    swaps = {**_HELPERS, **dict.fromkeys(_KERNEL.findall(source), _nothing)}
    swaps = {name: value for name, value in swaps.items() if name in module}

    def replayed(args: list[Any]) -> Any:
        with _swapped(module, swaps):
            return call(args)

    compiled.current_callable = replayed
    return compiled


@contextlib.contextmanager
def _swapped(module: dict[str, Any], swaps: Mapping[str, Any]) -> Iterator[None]:
    saved = {name: module[name] for name in swaps}
    module.update(swaps)
    try:
        yield
    finally:
        module.update(saved)


def mode_options(mode: str | None, options: Mapping[str, Any] | None, dynamic: bool | None) -> dict[str, Any]:
    """inductor's configuration for ``torch.compile(mode=..., options=...)``."""
    from torch._inductor import list_mode_options

    chosen = dict(list_mode_options(mode, dynamic)) if mode else {}
    chosen.update(options or {})
    chosen.pop("triton.cudagraphs", None)  # CUDA graphs: no CPU code changes (graphmem.trace.compiled)
    return chosen


def compile_with_inductor(gm: torch.fx.GraphModule, example_inputs: list[Any], config: Mapping[str, Any],
                          last_step: Callable[[Any], Any],
                          around: Callable[[], contextlib.AbstractContextManager[Any]]) -> Any:
    """What ``torch.compile(backend="inductor")`` makes of ``gm`` (AOTAutograd's forward and
    backward graphs, partitioned, each lowered by inductor), each graph's output passed
    through ``last_step``; each lowering inside ``around()`` (the backward's is made at the
    first backward, AOTAutograd's lazy lowering).  ``config``: inductor's, during the compile
    and the lazy lowering."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(graph: Any, inputs: Any, **kwargs: Any) -> Any:
        with around(), inductor_config.patch(dict(config)):
            return last_step(compile_fx_inner(graph, inputs, **kwargs))

    # AOTAutograd's cache would hand back a compiled forward and backward whole, inductor's
    # lowering (``inner``) skipped: their kernels would run on the fakes
    with inductor_config.patch(dict(config)), functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner)


def inductor_cache_dir() -> str:
    """The folder inductor writes its generated code and its compiled kernels to, made now and
    kept for the process (it names it in ``TORCHINDUCTOR_CACHE_DIR``: a later change of the
    temporary folder does not move it)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


@contextlib.contextmanager
def global_hooks_off() -> Iterator[None]:
    """Inside, no global module forward hook runs (``register_module_forward_pre_hook`` and
    ``register_module_forward_hook``'s tables are empty; each holds its hooks again after),
    and no default saved-tensor hook (``torch.autograd.graph.saved_tensors_hooks``' stack is
    empty; the same hooks are pushed back after)."""
    from torch.nn.modules import module

    hooks = torch._C._autograd
    stacked = []
    while (top := hooks._top_saved_tensors_default_hooks(True)) is not None:
        stacked.append(top)
        hooks._pop_saved_tensors_default_hooks()
    try:
        with _forward_hooks_off(module):
            yield
    finally:
        for pack, unpack in reversed(stacked):
            hooks._push_saved_tensors_default_hooks(pack, unpack)


@contextlib.contextmanager
def _forward_hooks_off(module: Any) -> Iterator[None]:
    tables = (module._global_forward_pre_hooks, module._global_forward_hooks,
              module._global_forward_hooks_always_called, module._global_forward_hooks_with_kwargs)
    saved = [dict(table) for table in tables]
    for table in tables:
        table.clear()
    try:
        yield
    finally:
        for table, held in zip(tables, saved, strict=True):
            table.update(held)


def compiles_a_module_call(target: Any) -> bool:
    """``target`` is a module's own call (what ``nn.Module.compile()`` hands torch.compile)."""
    return getattr(target, "__func__", None) is torch.nn.Module._call_impl
