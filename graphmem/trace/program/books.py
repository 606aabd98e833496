"""The books of a recorded program: what global hooks name while it runs.

Input: the recorder and the optimizer steps to record.  Output: ``Books`` (the program's models,
parameters, optimizers and steps) and ``hooks(books)``, the context manager that installs them:
a module called from outside any module is a model (its parameters and buffers named, its tensor
arguments the inputs, its outputs the outputs), autograd's ``backward`` the backward phase, any
torch.optim optimizer's ``step`` the optimizer phase (its gradients and state named there, the
values it reads from a real one-element copy; a step that steps other optimizers is one step
with them), ``Module._apply`` converting fake parameters, and ``torch.utils.swap_tensors``
(behind ``_apply`` for DTensor parameters) with the recorder letting go of the two tensors.
After the last step ``Enough`` is raised: not an Exception, so the program's ``finally`` blocks run.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from graphmem._torch_api import (
    MODULE_APPLY,
    backward_without_hop,
    fakes_take_foreach_paths,
    is_fake,
    module_apply,
    module_buffers,
    module_parameters,
    tree_flatten,
    unpatched_module_apply,
    unset_fake_temporarily,
)
from graphmem.patching import patched
from graphmem.records import Phase, Role
from graphmem.trace.compiled import compiler
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.step.replica import ValueReads
from graphmem.trace.step.run import mark_output, saving

__all__ = ["Books", "Enough", "hooks"]


class Enough(BaseException):
    """Raised at the end of the last optimizer step recorded; not an Exception, so the program's
    ``except Exception`` blocks let it through and its ``finally`` blocks run."""


class Books:
    """The program's models, parameters, optimizers and steps, seen through global hooks."""

    def __init__(self, recorder: Recorder, steps: int) -> None:
        self.recorder, self.steps = recorder, steps
        self.done = 0  # optimizer steps
        self.backwards = 0  # backward passes
        self.optimizer_made = False  # a torch.optim optimizer of the program's exists
        self.making_replica = False
        self.paths: dict[int, str] = {}  # id(module) -> its path in the model it belongs to
        self.models: list[str] = []
        self.optimizers: list[str] = []
        self.params: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its name
        self.replicas: dict[int, torch.optim.Optimizer | None] = {}
        recorder.answers.use_replica(None)  # no optimizer step runs before the program's first
        # id(optimizer) -> (closure calls its replica's steps made, its class) for a step that takes a closure
        self.closure_calls: dict[int, tuple[int, str]] = {}
        self.reads: dict[str, int] = {}  # the program's line -> reads answered there
        # the optimizer steps running now, outermost first: whether another ran inside each (a
        # container of optimizers, as torchtitan's, steps each of its own inside its step)
        self.stepping: list[bool] = []

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
            self.recorder.answers.shadows.forget(p)  # its optimizer updates it: values no shadow follows

    @property
    def by_hand(self) -> bool:
        """The program updates its parameters itself (no torch.optim optimizer): a step is a
        backward pass and what follows it, up to the next forward."""
        return not self.optimizer_made and self.backwards > 0

    @property
    def steps_done(self) -> int:
        return self.backwards if self.by_hand else self.done

    def forward_pre(self, module: nn.Module, args: Any) -> None:
        recorder = self.recorder
        if not recorder.modules.stack and self.by_hand:  # a new iteration of an update by hand
            if self.backwards >= self.steps:
                self._stop()
            recorder.iteration = self.backwards
        if not recorder.modules.stack:  # called by the program itself
            if id(module) not in self.paths:
                self.adopt(module)
            if recorder.phase != Phase.BACKWARD or not torch.is_grad_enabled():
                recorder.phase = Phase.FORWARD
            for t in tree_flatten(args)[0]:
                if isinstance(t, torch.Tensor) and t.grad_fn is None and not t.requires_grad:
                    recorder.mark(t, Role.INPUT, "batch")
        recorder.modules.stack.append(self.paths.get(id(module), type(module).__name__))

    def forward_post(self, module: nn.Module, args: Any, out: Any) -> None:
        recorder = self.recorder
        if recorder.modules.stack:
            recorder.modules.stack.pop()
        if not recorder.modules.stack and recorder.phase == Phase.FORWARD:
            mark_output(recorder, out)
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
        if self.stepping:
            self.stepping[-1] = True
        self.stepping.append(False)
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                self.parameter(p, f"param_groups[{g}][{i}]")
        self.gradients()
        recorder.phase = Phase.OPTIMIZER
        recorder.answers.use_replica(self._replica_reads(opt))
        return self._closure_then_the_step(args, kwargs)

    def _closure_then_the_step(self, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        """``step(closure)`` (Lightning, LBFGS): the closure runs the forward and the backward
        inside the step; the update after it is the optimizer phase again."""
        # torch hands the hooks ``step``'s own arguments: ``(self, closure, ...)``
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if not callable(closure):
            return None

        def then_the_step() -> Any:
            result = closure()
            self.gradients()
            self.recorder.phase = Phase.OPTIMIZER
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": then_the_step}
        return (args[0], then_the_step, *args[2:]), kwargs

    def step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        recorder = self.recorder
        if self._is_replica(opt):
            return
        if not self.stepping.pop() and type(opt).__name__ not in self.optimizers:
            self.optimizers.append(type(opt).__name__)  # one that stepped no other: it updates parameters
        for p, state in opt.state.items():
            name = self.params.get(p, "") if isinstance(p, torch.Tensor) else ""
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    recorder.mark(value, Role.OPTIMIZER_STATE, f"{name}.{key}", owner=name)
        if self.stepping:  # inside another optimizer's step: part of that one
            return
        recorder.poll()
        recorder.answers.use_replica(None)  # the step is over: reads are the program's own again
        self.done += 1
        if self.done >= self.steps:
            self._stop()
        recorder.iteration = self.done
        recorder.phase = Phase.PROGRAM

    def _stop(self) -> None:
        self.recorder.poll(everything=True)  # what is live now stays live: the program stops here
        self.recorder.silent = True  # the program's finally blocks run unrecorded
        raise Enough

    def backward_done(self) -> None:
        self.gradients()
        self.backwards += 1
        if self.by_hand:
            self.recorder.phase = Phase.OPTIMIZER  # the update the program makes itself follows

    def _is_replica(self, opt: torch.optim.Optimizer) -> bool:
        return any(opt is replica for replica in self.replicas.values())

    def _replica_reads(self, opt: torch.optim.Optimizer) -> list[Any]:
        """What this step of ``opt`` reads, from its real copy on one-element parameters (made at
        the first step, stepped with zero gradients at each); none when it cannot be copied."""
        key = id(opt)
        with unset_fake_temporarily(), self.recorder.silenced():
            if key not in self.replicas:
                self.making_replica = True
                try:
                    self.replicas[key] = _replica(opt, self.recorder.books.on_gpu is not None)
                finally:
                    self.making_replica = False
            replica = self.replicas[key]
            if replica is None:
                return []
            reads = ValueReads()
            with reads:
                for group in replica.param_groups:
                    for p in group["params"]:
                        p.grad = torch.zeros_like(p)
                if _takes_closure(replica):
                    calls = _step_with_closure(replica, self.closure_calls.get(key, (0, ""))[0])
                    self.closure_calls[key] = (calls, type(opt).__name__)
                else:
                    replica.step()
            return reads.values


def _takes_closure(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step`` must be given a closure (LBFGS: it evaluates the loss itself)."""
    try:
        parameter = inspect.signature(opt.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _step_with_closure(replica: torch.optim.Optimizer, before: int) -> int:
    """Step ``replica`` with a closure whose loss keeps falling and whose gradients shrink
    without vanishing, over this step and the ones before (``before``: the closure's calls in
    the earlier steps), so that a step that iterates until it converges (LBFGS) runs its
    longest: every iteration it allows (``max_iter``), each adding to its history up to
    ``history_size``.  The values of the program's own loss are not known; this is the most
    memory its step can take.  Returns the closure's calls so far, this step's included."""
    calls = [before]
    params = [p for group in replica.param_groups for p in group["params"]]

    def closure() -> Any:  # a loss tensor (typed as a float in torch's stubs)
        calls[0] += 1
        for p in params:
            p.grad = torch.full_like(p, 1.0 / calls[0])
        return torch.tensor(-float(calls[0]))

    replica.step(closure)
    return calls[0]


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
    except Exception:  # broad: a class made from something else than param groups (a container of optimizers)
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
        own = [t for t in (*module_parameters(module).values(), *module_buffers(module).values()) if t is not None]
        depth[0] += 1
        try:
            if not any(isinstance(t, torch.Tensor) and (is_fake(t) or is_fake(t.data)) for t in own):
                result: nn.Module = original(module, fn, recurse)  # its children come back here
                return result
            if recurse:
                for child in module.children():
                    module_apply(child, fn)
            with torch.no_grad():
                for key, param in module_parameters(module).items():
                    if param is not None:
                        module_parameters(module)[key] = convert(param, lambda p: _parameter(p, fn))  # type: ignore[assignment]
                for key, buffer in module_buffers(module).items():
                    if buffer is not None:
                        module_buffers(module)[key] = convert(buffer, fn)
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
def hooks(books: Books) -> Iterator[None]:
    """The global hooks that keep ``books`` while the program runs (inside); all removed after."""
    recorder = books.recorder
    grad = torch.autograd.grad

    def run_backward(*args: Any, **kwargs: Any) -> None:
        recorder.phase = Phase.BACKWARD
        backward_without_hop(*args, **kwargs)  # the TorchFunctionModes active stay so (the GPU's kernels)
        books.backward_done()

    def run_grad(*args: Any, **kwargs: Any) -> Any:
        before, recorder.phase = recorder.phase, Phase.BACKWARD
        try:
            return grad(*args, **kwargs)
        finally:
            recorder.phase = before

    made = torch.optim.Optimizer.__init__
    swap = torch.utils.swap_tensors

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:  # Module._apply's for DTensor parameters
        with recorder.swapping(t1, t2, (books.params,)):
            swap(t1, t2)

    def optimizer_made(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        made(opt, *args, **kwargs)
        books.optimizer_made = books.optimizer_made or not books.making_replica

    with patched((torch.autograd, "backward", run_backward), (torch.autograd, "grad", run_grad),
                 (torch.optim.Optimizer, "__init__", optimizer_made), (torch.utils, "swap_tensors", swap_tensors),
                 (torch, "compile", compiler(recorder, torch.compile)),
                 (nn.Module, MODULE_APPLY, _applying(unpatched_module_apply(), recorder))), \
            torch.autograd.graph.saved_tensors_hooks(saving(recorder), lambda t: t), fakes_take_foreach_paths():
        handles = [nn.modules.module.register_module_parameter_registration_hook(
                       lambda module, name, p: recorder.answers.shadows.forget(p) if p is not None else None),
                   nn.modules.module.register_module_forward_pre_hook(books.forward_pre),
                   nn.modules.module.register_module_forward_hook(books.forward_post, always_call=True),
                   register_optimizer_step_pre_hook(books.step_pre),
                   register_optimizer_step_post_hook(books.step_post)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
