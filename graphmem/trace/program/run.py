"""A training program recorded as it runs (``graphmem run``).

Input: a script (or ``-m`` module), its own argv, how many optimizer steps to record.
Output: a ``ProgramTrace``: the ``Trace`` of every aten op the program dispatched from its
first line to the end of its K-th optimizer step, and what the run did (steps, how it ended,
what was left out).  Knows nothing of categories, peaks, reports or the command line.

How: the program runs as ``python SCRIPT ARGS`` would run it (``__main__``, ``sys.argv``,
``sys.path[0]``) under the recording fake mode with the ``Recorder`` on top, so every tensor
it makes is a fake one (no memory, no weights) and every op is seen.  Global hooks give the
books what analyze's driver knows by construction: a module called from outside any module is
a model (its parameters and buffers named from it, its tensor arguments the inputs, its outputs
the outputs), autograd's ``backward`` is the backward phase, the optimizer's step (any
torch.optim optimizer) the optimizer phase, its gradients and its state named there.  After
the K-th step the program is stopped with an exception no ``except Exception`` catches, so its
``finally`` blocks run (unrecorded).

Values: a fake tensor holds none.  A value the optimizer step reads (Adam's step count) comes
from a real copy of the program's optimizer on one-element parameters, stepped alongside it
(graphmem.trace.step.replica's idea); any other read (``loss.item()`` for a log line) is taken
as 0 and noted, with the program's line.
"""

from __future__ import annotations

import collections
import contextlib
import os
import runpy
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from graphmem._torch_api import (
    data_loading_in_process,
    fakes_take_foreach_paths,
    is_fake,
    quiet_fake_tensor_logs,
    tree_flatten,
    unset_fake_temporarily,
)
from graphmem.errors import TraceError
from graphmem.job.program import Program
from graphmem.records import Phase, Role, Trace
from graphmem.trace.core.fake_mode import recording_fake_mode
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.program.effects import program_line, skipping_saves
from graphmem.trace.program.gpu import GpuTarget, on_the_gpu
from graphmem.trace.program.loads import loading_headers_only
from graphmem.trace.program.ranks import as_rank
from graphmem.trace.recording import saving
from graphmem.trace.rules import rules_for
from graphmem.trace.step.replica import ValueReads

__all__ = ["ProgramTrace", "trace_program"]

# graphmem run's own options, named in the error when a program that refused its argv got one
_RUN_OPTIONS = frozenset({"--steps", "--device", "--format", "--units", "--output", "-o", "--debug", "--timeout",
                          "--progress", "--no-progress", "--depth", "--top", "--timeline", "--snapshot", "--html",
                          "--gpu", "--sdpa", "--alloc-conf", "--budget", "--margin", "--nproc-per-node", "--nnodes",
                          "--ranks"})


@dataclass(frozen=True)
class ProgramTrace:
    """The recording of a program, and how its run went."""

    trace: Trace
    steps: int  # optimizer steps recorded
    stopped: bool  # stopped after the steps asked for (else: the program ended by itself)
    models: tuple[str, ...]  # the classes of the modules it called, in order of first call
    optimizers: tuple[str, ...]  # the classes of the optimizers it stepped


class _Enough(BaseException):
    """Raised at the end of the last optimizer step recorded; not an Exception, so the program's
    ``except Exception`` blocks let it through and its ``finally`` blocks run."""


class _Books:
    """The program's models, parameters, optimizers and steps, seen through global hooks."""

    def __init__(self, recorder: Recorder, steps: int) -> None:
        self.recorder, self.steps = recorder, steps
        self.done = 0
        self.paths: dict[int, str] = {}  # id(module) -> its path in the model it belongs to
        self.models: list[str] = []
        self.optimizers: list[str] = []
        self.params: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its name
        self.replicas: dict[int, torch.optim.Optimizer | None] = {}
        self.reads: dict[str, int] = {}  # the program's line -> reads answered there

    # -- modules ----------------------------------------------------------------------
    def adopt(self, model: nn.Module) -> None:
        """A module called from outside any module: a model.  Its modules get paths (the first
        model's from the root, as analyze names them; a later one's under its class name) and
        its parameters and buffers their names."""
        prefix = f"{type(model).__name__}." if self.models else ""
        inner = getattr(model, "module", None)  # DistributedDataParallel / DataParallel wrap the model
        self.models.append(f"{type(inner).__name__} ({type(model).__name__})" if isinstance(inner, nn.Module)
                           else type(model).__name__)
        for name, module in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(module), (prefix + name).rstrip(".") if name or prefix else "")
        for name, p in model.named_parameters():
            self.parameter(p, prefix + name)
        for name, b in model.named_buffers():
            if b is not None:
                self.recorder.mark(b, Role.BUFFER, prefix + name, owner=prefix + name)

    def parameter(self, p: torch.Tensor, name: str) -> None:
        if p not in self.params:
            self.params[p] = name
            self.recorder.mark(p, Role.PARAMETER, name, owner=name)

    def forward_pre(self, module: nn.Module, args: Any) -> None:
        recorder = self.recorder
        if not recorder.module_stack:  # called by the program itself
            if id(module) not in self.paths:
                self.adopt(module)
            if recorder.phase != Phase.BACKWARD or not torch.is_grad_enabled():
                recorder.phase = Phase.FORWARD
            for t in tree_flatten(args)[0]:
                if isinstance(t, torch.Tensor) and t.grad_fn is None and not t.requires_grad:
                    recorder.mark(t, Role.INPUT, "batch")
        recorder.module_stack.append(self.paths.get(id(module), type(module).__name__))

    def forward_post(self, module: nn.Module, args: Any, out: Any) -> None:
        recorder = self.recorder
        if recorder.module_stack:
            recorder.module_stack.pop()
        if not recorder.module_stack and recorder.phase == Phase.FORWARD:
            leaves = out.to_tuple() if hasattr(out, "to_tuple") else out
            for t in tree_flatten(leaves)[0]:
                if isinstance(t, torch.Tensor):
                    recorder.mark(t, Role.OUTPUT)
            recorder.phase = Phase.LOSS  # the program's code between the forward and the backward

    # -- backward ---------------------------------------------------------------------
    def gradients(self) -> None:
        for p, name in list(self.params.items()):
            if p.grad is not None:
                self.recorder.mark(p.grad, Role.GRADIENT, f"{name}.grad", owner=name)

    # -- the optimizer ----------------------------------------------------------------
    def step_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        recorder = self.recorder
        if self._is_replica(opt):
            return None
        if type(opt).__name__ not in self.optimizers:
            self.optimizers.append(type(opt).__name__)
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                self.parameter(p, f"param_groups[{g}][{i}]")
        self.gradients()
        recorder.phase = Phase.OPTIMIZER
        recorder.scalar_reads, recorder._read_index = self._replica_reads(opt), 0
        return self._closure_then_the_step(args, kwargs)

    def _closure_then_the_step(self, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """``step(closure)`` (Lightning, LBFGS): the closure runs the forward and the backward
        inside the step; the update after it is the optimizer phase again."""
        closure = kwargs.get("closure", args[0] if args else None)
        if not callable(closure):
            return None

        def then_the_step() -> Any:
            result = closure()
            self.gradients()
            self.recorder.phase = Phase.OPTIMIZER
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": then_the_step}
        return (then_the_step, *args[1:]), kwargs

    def step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        recorder = self.recorder
        if self._is_replica(opt):
            return
        for p, state in opt.state.items():
            name = self.params.get(p, "") if isinstance(p, torch.Tensor) else ""
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    recorder.mark(value, Role.OPTIMIZER_STATE, f"{name}.{key}", owner=name)
        recorder.poll()
        self.done += 1
        if self.done >= self.steps:
            recorder.poll(everything=True)  # what is live now stays live: the program stops here
            recorder._silent = True  # the program's finally blocks run unrecorded
            raise _Enough
        recorder.iteration = self.done
        recorder.phase = Phase.PROGRAM

    def _is_replica(self, opt: torch.optim.Optimizer) -> bool:
        return any(opt is replica for replica in self.replicas.values())

    def _replica_reads(self, opt: torch.optim.Optimizer) -> list[Any]:
        """What this step of ``opt`` reads, from its real copy on one-element parameters (made at
        the first step, stepped with zero gradients at each); none when it cannot be copied."""
        key = id(opt)
        with unset_fake_temporarily(), self.recorder.silenced():
            if key not in self.replicas:
                self.replicas[key] = _replica(opt, self.recorder.on_gpu is not None)
            replica = self.replicas[key]
            if replica is None:
                return []
            reads = ValueReads()
            with reads:
                for group in replica.param_groups:
                    for p in group["params"]:
                        p.grad = torch.zeros_like(p)
                replica.step()
            return reads.values


def _replica(opt: torch.optim.Optimizer, gpu: bool) -> torch.optim.Optimizer | None:
    """A real copy of ``opt`` on one-element CPU parameters, taking the implementation ``opt``
    takes (on the GPU: foreach where the program chose none, as PyTorch picks for CUDA)."""
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [nn.Parameter(torch.zeros([1] * p.dim())) for p in group["params"]]}
              for group in opt.param_groups]
    for group in groups if gpu else ():
        if "foreach" in group and group["foreach"] is None and not group.get("fused") \
                and not group.get("differentiable"):
            group["foreach"] = True
    try:
        return type(opt)(groups, **_required(opt))
    except (TypeError, ValueError, RuntimeError):
        return None


def _required(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Constructor arguments a param group does not carry (none for torch.optim's optimizers)."""
    return {}


def _applying(original: Any, recorder: Recorder) -> Any:
    """``Module._apply`` (behind ``.to()``, ``.half()``, ``.cuda()``) for the program's fake
    parameters: torch swaps a fake parameter's contents with the converted one's
    (``torch.utils.swap_tensors``, for tensor subclasses), which a tensor the recorder watches
    refuses; here a converted parameter takes the converted data (``param.data = ...``, torch's
    default for plain tensors), so it stays the same object; an unchanged one stays as it is.
    A parameter or buffer two modules share (tied weights) is converted once and stays shared."""
    converted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(old) -> (old, new), in one .to()
    depth = [0]

    def convert(old: torch.Tensor, make: Any) -> torch.Tensor:
        if id(old) not in converted:
            converted[id(old)] = (old, make(old))
        return converted[id(old)][1]

    def apply(module: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
        own = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
        depth[0] += 1
        try:
            if not any(isinstance(t, torch.Tensor) and (is_fake(t) or is_fake(t.data)) for t in own):
                result: nn.Module = original(module, fn, recurse)  # its children come back here
                return result
            if recurse:
                for child in module.children():
                    child._apply(fn)
            with torch.no_grad():
                for key, param in module._parameters.items():
                    if param is not None:
                        module._parameters[key] = convert(param, lambda p: _parameter(p, fn))  # type: ignore[assignment]
                for key, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[key] = convert(buffer, fn)
        finally:
            depth[0] -= 1
            if not depth[0]:
                converted.clear()
                recorder.poll(everything=True)  # the converted-from tensors died here
        return module
    return apply


def _parameter(param: Any, fn: Any) -> Any:
    """``param`` converted by ``fn`` in place, as torch converts a parameter by default
    (``param.data = fn(param)``): the same Parameter, so an optimizer made before the
    conversion still holds it; its gradient converted too."""
    new = fn(param)
    if new is param:
        return param
    if not is_fake(param):  # a Parameter around a fake (as from_pretrained's loading makes them): a new one
        made = nn.Parameter(new, param.requires_grad)
        if param.grad is not None:
            made.grad = fn(param.grad)
        return made
    param.data = new
    if param.grad is not None:
        param.grad = fn(param.grad)
    return param


@contextlib.contextmanager
def _hooks(books: _Books) -> Iterator[None]:
    recorder = books.recorder
    backward, grad = torch.autograd.backward, torch.autograd.grad

    def run_backward(*args: Any, **kwargs: Any) -> Any:
        recorder.phase = Phase.BACKWARD
        try:
            return backward(*args, **kwargs)
        finally:
            books.gradients()

    def run_grad(*args: Any, **kwargs: Any) -> Any:
        before, recorder.phase = recorder.phase, Phase.BACKWARD
        try:
            return grad(*args, **kwargs)
        finally:
            recorder.phase = before

    handles = [nn.modules.module.register_module_forward_pre_hook(books.forward_pre),
               nn.modules.module.register_module_forward_hook(books.forward_post, always_call=True),
               register_optimizer_step_pre_hook(books.step_pre),
               register_optimizer_step_post_hook(books.step_post)]
    torch.autograd.backward, torch.autograd.grad = run_backward, run_grad
    compile_, apply = torch.compile, nn.Module._apply
    torch.compile = _eager_compile
    nn.Module._apply = _applying(apply, recorder)  # type: ignore[method-assign]
    try:
        with torch.autograd.graph.saved_tensors_hooks(saving(recorder), lambda t: t), fakes_take_foreach_paths():
            yield
    finally:
        torch.autograd.backward, torch.autograd.grad = backward, grad
        torch.compile, nn.Module._apply = compile_, apply  # type: ignore[method-assign]
        for handle in handles:
            handle.remove()


def _eager_compile(model: Any = None, **kwargs: Any) -> Any:
    """``torch.compile``: the program's code runs eagerly (as ``torch.compile(..., backend="eager")``
    without the graph capture)."""
    if model is None:
        return lambda fn: fn
    return model


@contextlib.contextmanager
def _as_main(program: Program) -> Iterator[None]:
    """``sys.argv`` and ``sys.path[0]`` as Python sets them for the program; restored after."""
    argv, path = sys.argv[:], sys.path[:]
    sys.argv = [program.target, *program.argv]
    sys.path.insert(0, os.getcwd() if program.module else os.path.dirname(os.path.abspath(program.target)))
    try:
        yield
    finally:
        sys.argv[:], sys.path[:] = argv, path


def trace_program(program: Program, *, gpu: GpuTarget | None = None, rank: int = 0) -> ProgramTrace:
    """Run ``program`` under the recorder until its ``program.steps``-th optimizer step ends:
    on the CPU, or with ``gpu`` its "cuda" that GPU (graphmem.trace.program.gpu); as ``rank``
    of its ``nproc_per_node`` (graphmem.trace.program.ranks).

    Raises:
        TraceError: the program raised (its own frames named), or ended or exited before its
            first optimizer step.
    """
    recorder = Recorder(rules_for("cuda" if gpu else "cpu"))
    recorder.phase = Phase.PROGRAM
    recorder.held = frozenset()  # the program holds its own tensors: each dies when it lets go of it
    recorder.read_value = 0  # a value the program reads (loss.item()): see the module docstring
    recorder.read_note = "the program read a value of a tensor, taken as 0"
    recorder.where = program_line
    books = _Books(recorder, program.steps)
    fake_mode = recording_fake_mode()
    stopped, exited = False, None
    workers: list[int] = []
    saves: list[str] = []
    snapshot = lambda: _trace(recorder, books, ())
    on_gpu = on_the_gpu(recorder, gpu, snapshot) if gpu else contextlib.nullcontext()
    with _as_main(program), quiet_fake_tensor_logs(), on_gpu, \
            as_rank(program, rank, gpu is not None, recorder.resized, recorder.silenced, recorder.hold), \
            data_loading_in_process(workers.append), \
            skipping_saves(saves), \
            loading_headers_only(recorder.map_from_file), fake_mode, recorder, _hooks(books):
        try:
            if program.module:
                runpy.run_module(program.target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(program.target, run_name="__main__")
        except _Enough:
            stopped = True
        except SystemExit as exc:
            exited = exc.code
        except Exception as exc:
            raise TraceError(_failure(program, exc, books.done)) from exc
        finally:
            recorder._silent = False
    if not stopped:
        recorder.poll(everything=True)
    if books.done == 0:
        how = "ended" if exited in (None, 0) else f"exited with {exited!r}"
        ours = [a for a in program.argv if a.split("=")[0] in _RUN_OPTIONS]
        hint = (f"; {', '.join(ours)} went to the program: graphmem's own options go before the script "
                "(everything after it is the program's argv)" if ours else
                ". graphmem run records a training program up to --steps optimizer steps")
        raise TraceError(f"{program.command} {how} before its first optimizer step: nothing to analyse{hint}")
    notes = list(recorder.declared_notes())
    if not stopped:
        notes.append(f"the program ended after {books.done} optimizer step{'s' * (books.done > 1)} "
                     f"(--steps {program.steps} asked for more)")
    for what, count in collections.Counter(saves).items():
        notes.append(f"a checkpoint save was skipped (the tensors are fakes; nothing was written): {what}"
                     + (f", {count} times" if count > 1 else ""))
    if workers:
        notes.append(f"the data loader{'s' * (len(workers) > 1)} loaded in the program's process, not in "
                     f"{max(workers)} worker processes: the same batches, and the GPU's memory is the same")
    return ProgramTrace(trace=_trace(recorder, books, tuple(notes)), steps=books.done, stopped=stopped,
                        models=tuple(books.models), optimizers=tuple(books.optimizers))


def _trace(recorder: Recorder, books: _Books, notes: tuple[str, ...]) -> Trace:
    """The run recorded so far as a ``Trace`` (storages still live have no release)."""
    return Trace(mode="train", fx=recorder.graph, ops=tuple(recorder.ops), storages=recorder.freeze(),
                 optimizer=books.optimizers[0] if books.optimizers else None, assumptions=notes)


def _failure(program: Program, exc: BaseException, steps: int) -> str:
    """The program's error, its traceback cut to the program's own frames (not torch's, not
    graphmem's, not runpy's)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not any(part in f.filename for part in ("/torch/", "/graphmem/", "runpy.py", "<frozen"))]
    where = "".join(f"\n  {f.filename}:{f.lineno}: {(f.line or '').strip()}" for f in frames[-5:])
    after = f" after {steps} optimizer step{'s' * (steps != 1)}"
    return f"{program.command} raised {type(exc).__name__}: {str(exc).strip()}{after}{where}"
