"""``compiler(recorder)``: torch.compile with inductor's last step replayed on fake tensors."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import (
    compile_with_inductor,
    compiles_a_module_call,
    global_hooks_off,
    inductor_cache_dir,
    mode_options,
    replay_on_fakes,
)
from graphmem.errors import TraceError
from graphmem.trace.core.recorder import Recorder

__all__ = ["compiler", "compiler_folders"]

# compiled by every program (torchtitan's even with its compile option off) and recorded as the
# one fused kernel it compiles to (graphmem.trace.core.recorder): left as it is
_ONE_KERNEL = frozenset({"flex_attention"})
# torch's warning that global module hooks fire for the compiled module too: graphmem's hooks
_HOOKS_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


def compiler(recorder: Recorder, compile: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile``'s replacement; ``compile``: torch's own."""
    def replaced(model: Any = None, *, fullgraph: bool = False, dynamic: bool | None = None,
                 backend: Any = "inductor", mode: str | None = None,
                 options: Mapping[str, Any] | None = None, disable: bool = False) -> Any:
        if model is None:  # @torch.compile(...) as a decorator with arguments
            return lambda fn: replaced(fn, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                                       options=options, disable=disable)
        if disable or backend != "inductor" or getattr(model, "__name__", "") in _ONE_KERNEL \
                or recorder.books.on_gpu is not None or compiles_a_module_call(model):
            # another backend, a GPU target (inductor's CUDA code is not modelled yet), or
            # ``model.compile()`` (dynamo would trace graphmem's own global module hooks with
            # the module's call): the program's code runs eagerly, as graphmem ran it before
            return model
        recorder.compiles = True
        warnings.filterwarnings("ignore", message=_HOOKS_WARNING)  # graphmem's own hooks (below)
        config = mode_options(mode, options, dynamic)
        compiled = compile(model, backend=_backend(recorder, config), fullgraph=fullgraph, dynamic=dynamic)
        if isinstance(compiled, nn.Module):
            compiled.forward = _hooks_off(compiled.forward)
        return compiled
    return replaced


def _hooks_off(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A compiled module's forward, run without graphmem's global module hooks: they ran for
    the call itself (eagerly, on the compiled module), and dynamo would trace them (graphmem's
    books) with each module its code calls; ops inside are the compiled module's."""
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with global_hooks_off():
            return forward(*args, **kwargs)
    return run


def compiler_folders() -> tuple[str, ...]:
    """The folders torch.compile writes to while a program compiles: inductor's cache (its
    generated code, the C++ it hands to the compiler, the compiled kernels), written for real
    as in a real run (a C++ compiler, another process, reads them)."""
    return (inductor_cache_dir(),)


def _backend(recorder: Recorder, config: Mapping[str, Any]) -> Callable[..., Any]:
    """dynamo's backend: inductor's compile of each graph, quiet (its ops on its own fake
    tensors are not the program's), its wrapper replayed on the recording's fakes."""
    def last_step(compiled: Any) -> Any:
        try:
            return replay_on_fakes(compiled)
        except ValueError as exc:
            raise TraceError(f"torch.compile: {exc}; graphmem cannot record this compiled code") from exc

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        with _quiet(recorder):
            return compile_with_inductor(gm, example_inputs, config, last_step, lambda: _quiet(recorder))
    return backend


@contextlib.contextmanager
def _quiet(recorder: Recorder) -> Iterator[None]:
    """The recorder records nothing inside (nested uses keep it so to the outermost's end)."""
    was, recorder.silent = recorder.silent, True
    try:
        yield
    finally:
        recorder.silent = was
