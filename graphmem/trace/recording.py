"""Stage 2: trace.  module + input specs -> the recorded step as an fx graph with lifetimes.

Input: an nn.Module (on meta, or a user's instance), input specs, and the step to run.
Output: a ``Trace``: the fx graph of every aten op in real execution order (forward, the
autograd engine's backward, the torch.optim step), each op's phase and module, and each
storage's size, creation op and release op.

How: the model's parameters and buffers are swapped for fake tensors on the target device
(no memory; device-dependent branches still take the target's path), then the real step
runs under FakeTensorMode with the ``Recorder`` on top.  Training runs two iterations: the
first creates the optimizer state lazily, the second runs with that state resident.

The training step, per iteration (locals are released when it returns)::

    out = model(*inputs); loss = loss_fn(out); loss.backward(); opt.step()
    opt.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from graphmem._torch_api import (
    DATA_DEPENDENT_ERRORS,
    TENSOR_CHECK,
    UnsupportedOperatorException,
    backward_keeping_modes,
    check_with,
    expr_of,
    is_fake,
    quiet_fake_tensor_logs,
    shape_guards,
    size_symbol,
    storage_key,
    tensor_check,
    to_fake,
    tree_flatten,
)
from graphmem.errors import GraphmemError, TraceError, UnsupportedError, UserInputError
from graphmem.job.devices import cuda_calls_on_cpu
from graphmem.job.parallel import ParallelSpec
from graphmem.job.spec import KEPT_FRACTION, READ_VALUE, ROUTING, InputSpec
from graphmem.job.step import AMP_DTYPES, StepConfig
from graphmem.records import Phase, Role, SymbolicSizes, Trace
from graphmem.trace.core.fake_mode import recording_fake_mode, symbolic_fake_mode
from graphmem.trace.core.fakes import fake_inputs, fake_parameters
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.cuda_target.autocast import cuda_autocast, cuda_autocast_lists
from graphmem.trace.cuda_target.kernels import CudaKernels
from graphmem.trace.distributed import (
    Applied,
    RankFork,
    apply_parallel,
    fake_process_group,
    following_resizes,
    meta_copy,
    pipeline_schedule,
    pipeline_stage_module,
    pipeline_warmup_known,
    zero_partition,
)
from graphmem.trace.rules import RuleTable, rules_for
from graphmem.trace.step import generation
from graphmem.trace.step.optim import compute_loss, find_logits, make_optimizer, make_targets, selective_policy
from graphmem.trace.step.replica import optimizer_scalar_reads
from graphmem.trace.values.shadows import PREDICTED_BOXES, TARGETS, default_assumption, describe
from graphmem.trace.values.targets import BOXES, DEFAULT_BOXES, detection_targets, predicted_boxes

__all__ = ["trace_step", "MODES", "saving"]

MODES = ("inference", "train", "prefill", "decode")
GENERATION_MODES = ("prefill", "decode")


def trace_step(model: nn.Module, inputs: Sequence[InputSpec], *, mode: str = "train",
               step: StepConfig | None = None, device: str = "cpu",
               dtype: torch.dtype | None = None,
               rules: RuleTable | None = None, cuda: CudaKernels | None = None,
               assume: Mapping[str, str] | None = None, parallel: ParallelSpec | None = None,
               rank: int = 0, symbol: tuple[str, int] | None = None, fork: RankFork | None = None) -> Trace:
    """Record one inference call or ``step.iterations`` training iterations of ``model``.

    Args:
        model: the model; its own tensors are never modified (fakes are swapped in).
        inputs: example inputs; unnamed ones are positional, named ones keywords.
        mode: ``"inference"`` (eval, no_grad) or ``"train"``.
        step: how the training step runs (optimizer, loss, amp, checkpointing, ...).
        device: the target device the fake tensors report.
        dtype: convert floating parameters and buffers, as ``model.to(dtype)`` would.
        rules: per-op scratch rules for the target device.
        cuda: for the CUDA target, the kernel choices to apply; the fake tensors then report
            ``cpu`` (see graphmem.trace.cuda_target.kernels for why) and ``device`` is ignored.
        assume: input name -> assumed value (``ones``, ``zeros``, ``arange`` or an integer)
            for answering value reads; see graphmem.trace.values.shadows for the defaults.
        parallel: data-parallel or sharded training (graphmem.trace.distributed.parallel); the trace is
            then ``rank``'s, with a fake process group of the spec's world size.
        fork: ZeRO-1 (graphmem.trace.distributed.rank_fork): at the first optimizer step, fork a child
            per other rank of ``fork.ranks`` that records the rest of the step as that rank.
        symbol: (letter, value): the inputs' ``symbolic`` dimensions are recorded as one size
            symbol with that value; the trace's ``sizes`` then give its sizes at any value
            where its guards hold (graphmem.trace.symbolic).

    Returns:
        The Trace.

    Raises:
        UserInputError: the model failed on the given inputs.
        TraceError / UnsupportedError: the model cannot be recorded.
    """
    if mode not in MODES:
        raise UserInputError(f"unknown mode {mode!r}; expected one of: {', '.join(MODES)}")
    step = step or StepConfig()
    recorder = Recorder(rules or rules_for(device))
    _fresh_caches(model)
    if cuda is not None:
        cuda.position = lambda: len(recorder.ops)
    fake_mode = symbolic_fake_mode() if symbol is not None else recording_fake_mode()
    size = size_symbol(fake_mode, symbol[0], symbol[1]) if symbol is not None else None
    target = torch.device("cpu" if cuda is not None else device)
    given = model  # errors name the user's class, not the one fully_shard makes
    pipelined = parallel is not None and parallel.pipelined
    if pipelined:
        _check_pipeline(mode, step)
    if parallel is not None and (parallel.shards or parallel.parallelize is not None or pipelined):
        model = meta_copy(model)  # fully_shard (and user code) changes the module's class and parameters
    with _recursion_room(), cuda_calls_on_cpu(device, tensors_on=target.type, functions=False), \
            fake_parameters(model, fake_mode, target, dtype) as (names, values), _process_group(parallel, rank):
        pipeline: _Pipeline | None = None
        if parallel is not None and pipelined:
            pipeline = _Pipeline(model, parallel, rank, fake_mode, fake_inputs(inputs, fake_mode, target, size), step)
            applied: Applied | None = Applied(model=pipeline.stage_module, inner=pipeline.stage_module, buffers=[])
        else:
            applied = apply_parallel(model, parallel, fake_mode) if parallel else None
        inner = applied.inner if applied else model
        if applied:  # the parameters now are the engine's (sharded) ones
            names = _parameter_names(inner)
        with recorder.tracking_modules(inner):
            args, kwargs = pipeline.inputs if pipeline else fake_inputs(inputs, fake_mode, target, size)
            for tensor, (name, role) in names.items():
                recorder.add_placeholder(tensor, name)
                recorder.mark(tensor, role, name, owner=name)
            for tensor in applied.buffers if applied else ():
                recorder.mark(tensor, Role.COMMUNICATION, "gradient buckets")
            for tensor, value in values.items():
                recorder.shadows.built(tensor, value)
            _declare_inputs(recorder, inputs, args, kwargs, assume or {})
            if mode == "train":
                _declare_targets(recorder, inner, args, kwargs, fake_mode, target, assume or {})
            kv_bytes = 0
            with _errors_explained(recorder, given), quiet_fake_tensor_logs():
                if mode == "train":
                    _read_optimizer_values(inner, step, target, recorder, parallel, rank)
                    if fork is not None:
                        fork.reads = {r: _optimizer_reads(inner, step, target, parallel, r) for r in fork.ranks}
                autocast = functools.partial(_autocast, step, target, cuda is not None)
                with fake_mode, recorder, cuda or contextlib.nullcontext(), _not_tracing_to_libraries(), \
                        _no_op_swaps(), _checks_pass(recorder), _cuda_autocast_rules(cuda is not None, step), \
                        _buffers_replaced(recorder), \
                        following_resizes(recorder.resized):
                    if pipeline is not None:
                        _run_pipeline(pipeline, args, kwargs, recorder, step, target, autocast)
                    elif mode == "inference":
                        _run_inference(applied.model if applied else model, args, kwargs, recorder, autocast)
                    elif mode == "train":
                        _run_training(applied.model if applied else model, inner, args, kwargs, recorder, step,
                                      target, autocast, zero=bool(parallel and parallel.degree("zero1") > 1),
                                      fork=fork)
                    else:
                        kv_bytes = _run_generation(model, kwargs, recorder, mode, autocast)
                recorder.poll(everything=True)
                recorder.release_replaced(inner)
    notes = recorder.assumptions + recorder.declared_notes() + describe(recorder.shadows.used, assume or {})
    sizes = None
    if size is not None and not recorder.shadows.used and not recorder.bounded:  # else: values at the hint
        assert symbol is not None
        sizes = SymbolicSizes(name=symbol[0], symbol=expr_of(size), hint=symbol[1],
                              storages={s.sid: s.sizes for s in recorder.storages if s.sizes is not None},
                              ops=dict(recorder.op_sizes), guards=shape_guards(fake_mode))
    return Trace(mode=mode, fx=recorder.graph, ops=tuple(recorder.ops), storages=recorder.freeze(),
                 optimizer=step.optimizer if mode == "train" else None, assumptions=tuple(notes),
                 kv_cache_bytes=kv_bytes, sizes=sizes)


def _run_generation(model: nn.Module, kwargs: dict[str, Any], recorder: Recorder, mode: str,
                    autocast: Callable[[], AbstractContextManager[Any]]) -> int:
    """``prefill``: the prompt's forward; ``decode``: fill the cache, then one decode step.
    Returns the bytes of the KV cache at the end (its storages, each counted once)."""
    model.eval()
    recorder.phase = Phase.PREFILL
    with torch.no_grad(), autocast():
        if mode == "prefill":
            cache = generation.prefill(model, kwargs["input_ids"])
        else:
            def start_decode() -> None:
                recorder.phase = Phase.DECODE
            cache = generation.decode_with_full_cache(model, kwargs["input_ids"], kwargs["next_token"],
                                                      start_decode)
    storages = {}
    for tensor in generation.cache_tensors(cache):
        recorder.mark(tensor, Role.OUTPUT, "kv cache")
        key, _, nbytes = storage_key(tensor)
        storages[key] = nbytes
    recorder.poll()  # the cache is still referenced here: it stays live to the end
    return sum(storages.values())


@contextlib.contextmanager
def _process_group(parallel: ParallelSpec | None, rank: int) -> Iterator[None]:
    if parallel is None:
        yield
        return
    with fake_process_group(parallel.world_size, rank):
        yield


def _fresh_caches(model: nn.Module) -> None:
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
        if isinstance(value, functools._lru_cache_wrapper):
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


def _parameter_names(model: nn.Module) -> dict[torch.Tensor, tuple[str, Role]]:
    """Parameters and buffers after a strategy was applied (a DTensor names its local shard)."""
    names: dict[torch.Tensor, tuple[str, Role]] = {p: (name, Role.PARAMETER) for name, p in model.named_parameters()}
    for name, b in model.named_buffers():
        names.setdefault(b, (name, Role.BUFFER))
    return names


def _declare_inputs(recorder: Recorder, specs: Sequence[InputSpec], args: list[Any],
                    kwargs: dict[str, Any], assume: Mapping[str, str]) -> None:
    """Placeholders, the input role, and the assumed values of integer inputs (and with
    ``nonzero``, the fraction value-dependent sizes keep)."""
    if KEPT_FRACTION in assume:
        recorder.kept = float(assume[KEPT_FRACTION])
    if READ_VALUE in assume:
        recorder.read_value = int(assume[READ_VALUE])
    recorder.shadows.routing = assume.get(ROUTING, recorder.shadows.routing)
    named = {KEPT_FRACTION, READ_VALUE, ROUTING, BOXES}  # assumptions that are not about one input
    unknown = set(assume) - {s.name or f"input_{i}" for i, s in enumerate(specs)} - named
    if unknown:
        raise UserInputError(f"--assume names {', '.join(sorted(unknown))}, which is not an input; "
                             f"inputs: {', '.join(s.name or f'input_{i}' for i, s in enumerate(specs))}")
    positional = iter(args)
    for i, spec in enumerate(specs):
        name = spec.name or f"input_{i}"
        tensor = kwargs[spec.name] if spec.name else next(positional)
        recorder.add_placeholder(tensor, name)
        recorder.mark(tensor, Role.INPUT, name)
        kind = assume.get(name) or default_assumption(name, spec.dtype)
        if kind:
            recorder.shadows.assume(tensor, name, kind)


def _declare_targets(recorder: Recorder, model: nn.Module, args: list[Any], kwargs: dict[str, Any],
                     fake_mode: Any, device: torch.device, assume: Mapping[str, str]) -> None:
    """A detection model trained without targets gets graphmem's (graphmem.trace.values.targets): a
    keyword input ``targets`` of fake tensors whose values are known, noted in the report."""
    try:
        boxes = int(assume.get(BOXES, DEFAULT_BOXES))
    except ValueError:
        boxes = -1
    if boxes < 1:
        raise UserInputError(f"--assume boxes={assume.get(BOXES)}: expected a positive number of ground-truth "
                             "boxes per image, e.g. boxes=8")
    real = detection_targets(model, args, kwargs, boxes)
    if real is None:
        return
    fakes: list[dict[str, torch.Tensor]] = []
    for i, target in enumerate(real):
        fakes.append({})
        for key, value in target.items():
            fake = to_fake(fake_mode, torch.empty_like(value, device="meta"), device)
            name = f"targets[{i}].{key}"
            recorder.add_placeholder(fake, name)
            recorder.mark(fake, Role.INPUT, name)
            recorder.shadows.built(fake, value, TARGETS)
            fakes[-1][key] = fake
    kwargs["targets"] = fakes
    parts = ", ".join(k for k in real[0] if k not in ("boxes", "labels"))
    recorder.assumptions.append(
        f"training: no targets were given, so each image gets {boxes} ground-truth boxes (half the image's "
        f"width and height each, on a grid, class 1{', with ' + parts if parts else ''}); --assume boxes=N "
        "changes how many")


CHECK_PASSED = ("the model asserts a condition on its values (torch._check_tensor_all, as transformers' "
                "torch_compilable_check calls it); taken to hold, as it does in every run that completes")


@contextlib.contextmanager
def _buffers_replaced(recorder: Recorder) -> Iterator[None]:
    """While recording, tell ``recorder`` of each buffer the model assigns over (I-BERT's
    quantizers keep their running range so: ``self.x_min = torch.min(self.x_min, x_min)``)."""
    def hook(module: nn.Module, name: str, value: Any) -> None:
        old = module._buffers.get(name)
        if isinstance(old, torch.Tensor):
            recorder.buffer_replaced(old, value)

    handle = torch.nn.modules.module.register_module_buffer_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _checks_pass(recorder: Recorder) -> Iterator[None]:
    """``torch._check_tensor_all_with(error, cond)`` on values no shadow knows (VITS: ``all(discriminant
    >= 0)``): the reduction runs, as in a real run; its value is taken to be true, noted once.
    ``torch.isfinite`` of such values: true everywhere (graphmem.trace.values.shadows, finite checks).
    ``format(t)`` of a one-element tensor reads its value, as a real tensor's does."""
    original = tensor_check()

    def check(error_type: Any, cond: Any, message: Any = None) -> None:
        if isinstance(cond, torch.Tensor) and is_fake(cond) and cond.dtype == torch.bool:
            result = cond._is_all_true()
            if recorder.shadows.get(result) is not None:  # known: checked as torch checks it
                check_with(error_type, bool(result.item()), message)
            elif CHECK_PASSED not in recorder.assumptions:
                recorder.assumptions.append(CHECK_PASSED)
            return
        original(error_type, cond, message)

    def finite(x: Any) -> Any:  # torch.isfinite is no single op: its ops run, and its answer is known
        out = isfinite(x)
        if isinstance(x, torch.Tensor) and is_fake(x) and recorder.shadows.get(x) is None and is_fake(out):
            recorder.shadows.finite_check(out, True)
        return out
    def formatted(t: torch.Tensor, spec: str) -> str:  # f"expert_{idx}": a real 0-d tensor formats its .item()
        return format(t.item(), spec) if is_fake(t) and t.dim() == 0 else str_format(t, spec)
    isfinite, method, str_format = torch.isfinite, torch.Tensor.isfinite, torch.Tensor.__format__
    patched = ((torch, TENSOR_CHECK, check, original), (torch, "isfinite", finite, isfinite),
               (torch.Tensor, "isfinite", finite, method), (torch.Tensor, "__format__", formatted, str_format))
    for owner, name, new, _ in patched:
        setattr(owner, name, new)
    try:
        yield
    finally:
        for owner, name, _, old in patched:
            setattr(owner, name, old)


@contextlib.contextmanager
def _no_op_swaps() -> Iterator[None]:
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
    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


@contextlib.contextmanager
def _not_tracing_to_libraries() -> Iterator[None]:
    """Let libraries take the path they take in a real run.

    transformers treats a FakeTensor as "tracing" (utils/import_utils.py, is_tracing ->
    is_fake_tensor) and then, for example, always materialises the 4-D attention mask that a
    real run skips when the mask is all ones.  graphmem predicts the real run, so, while it
    records, transformers is told its tensors are not fake; the value reads this unlocks are
    answered from the declared input assumptions (graphmem.trace.values.shadows).
    """
    utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(utils, "is_fake_tensor", None)
    if utils is None or original is None:
        yield
        return
    setattr(utils, "is_fake_tensor", lambda x: False)  # noqa: B010
    try:
        yield
    finally:
        setattr(utils, "is_fake_tensor", original)  # noqa: B010


def _read_optimizer_values(model: nn.Module, step: StepConfig, device: torch.device,
                           recorder: Recorder, parallel: ParallelSpec | None = None, rank: int = 0) -> None:
    """Values the optimizer reads with .item(), from a real one-element replica (outside the modes)."""
    recorder.scalar_reads = _optimizer_reads(model, step, device, parallel, rank)
    if recorder.scalar_reads:
        recorder.assumptions.append(
            "optimizer step: the values its code reads (step counts and the like) come from a real run "
            "of the same optimizer on tiny parameters with finite gradients")


def _optimizer_reads(model: nn.Module, step: StepConfig, device: torch.device, parallel: ParallelSpec | None,
                     rank: int) -> list[Any]:
    ndims = [p.dim() for p in model.parameters() if p.requires_grad]
    if parallel is not None and parallel.degree("zero1") > 1:  # the rank steps its own partition only
        ndims = [ndims[i] for i in zero_partition(model, parallel.world_size)[rank]]
    return optimizer_scalar_reads(ndims, step, device.type) if ndims else []


def _run_inference(model: nn.Module, args: list[Any], kwargs: dict[str, Any], recorder: Recorder,
                   autocast: Callable[[], AbstractContextManager[Any]]) -> None:
    model.eval()
    recorder.phase = Phase.FORWARD
    boxes = functools.partial(recorder.shadows.built, source=PREDICTED_BOXES)
    with torch.no_grad(), autocast(), predicted_boxes(model, boxes):
        out = model(*args, **kwargs)
    _mark_output(recorder, out)
    recorder.poll()  # the output is still referenced here: it stays live to the end


class _Loop:
    """The training loop's fixed parts: what ``_micro_step`` and ``_optimizer_step`` share."""

    def __init__(self, model: nn.Module, inner: nn.Module, args: list[Any], kwargs: dict[str, Any],
                 recorder: Recorder, step: StepConfig, device: torch.device,
                 autocast: Callable[[], AbstractContextManager[Any]], zero: bool = False,
                 fork: RankFork | None = None) -> None:
        self.model, self.args, self.kwargs, self.recorder, self.step = model, args, kwargs, recorder, step
        self.params = {name: p for name, p in inner.named_parameters() if p.requires_grad}
        self.opt = make_optimizer(step, list(self.params.values()), zero=zero)
        self.fork = fork
        self.scaler = torch.amp.GradScaler(device.type) if step.amp == "fp16" else None
        self.autocast = autocast
        self.targets: list[torch.Tensor] = []  # created at the first loss, then kept like data


def _run_training(model: nn.Module, inner: nn.Module, args: list[Any], kwargs: dict[str, Any],
                  recorder: Recorder, step: StepConfig, device: torch.device,
                  autocast: Callable[[], AbstractContextManager[Any]], zero: bool = False,
                  fork: RankFork | None = None) -> None:
    """Train ``model`` (the module called: ``inner`` itself or its DDP wrapper) on the
    parameters of ``inner``."""
    model.train()
    loop = _Loop(model, inner, args, kwargs, recorder, step, device, autocast, zero, fork)
    # micro-steps after the second repeat it exactly (same tensors, gradients resident)
    micro_steps = min(step.grad_accum, 2)
    with torch.autograd.graph.saved_tensors_hooks(saving(recorder), lambda t: t), \
            _checkpointed(inner, step, recorder):
        for iteration in range(step.iterations):
            recorder.iteration = iteration
            if step.grad_accum == 1:
                held = _micro_step(loop)  # a plain step keeps out and loss through the update
                _optimizer_step(loop)
                del held
            else:
                for _ in range(micro_steps):
                    _micro_step(loop)
                _optimizer_step(loop)
            recorder.poll()


def _check_pipeline(mode: str, step: StepConfig) -> None:
    """What pp=N records: training, one step per iteration, without autocast."""
    if mode != "train":
        raise UserInputError(f"--parallel pp models the training step only, not --mode {mode}; use --mode train")
    if step.grad_accum != 1:
        raise UserInputError("--parallel pp: the pipeline's microbatches are its gradient accumulation; "
                             "use --microbatches instead of --grad-accum")
    if step.amp is not None:
        raise UnsupportedError("--parallel pp with --amp is not modelled yet")
    # imported before recording, as a trainer imports it: the import makes a 4-byte module
    # constant (the losses' sum reducer) that is no part of the step
    importlib.import_module("torch.distributed.pipelining")


class _Pipeline:
    """One rank's pipeline stage: its module, the example shapes, the schedule's settings."""

    def __init__(self, model: nn.Module, spec: ParallelSpec, rank: int, fake_mode: Any,
                 inputs: tuple[list[Any], dict[str, Any]], step: StepConfig) -> None:
        self.spec, self.rank, self.fake_mode, self.inputs, self.step = spec, rank, fake_mode, inputs, step
        self.stage_module, self.example_in, self.example_out = pipeline_stage_module(
            model, spec, rank, fake_mode, *inputs)
        self.first = rank == 0
        self.last = rank == spec.degree("pp") - 1

    def schedule(self) -> Any:
        kind = self.step.loss

        def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
            return compute_loss(kind, output, target)

        with self.fake_mode:
            return pipeline_schedule(self.stage_module, self.spec, self.rank, self.example_in, self.example_out,
                                     loss_fn)


def _run_pipeline(pipeline: _Pipeline, args: list[Any], kwargs: dict[str, Any], recorder: Recorder,
                  step: StepConfig, device: torch.device,
                  autocast: Callable[[], AbstractContextManager[Any]]) -> None:
    """A pipeline trainer's step on this rank, per iteration: ``schedule.step(*inputs)`` on the
    first stage, ``schedule.step(target=targets, losses=losses)`` on the last, ``schedule.step()``
    in between; then the optimizer step and zero_grad.  The phases follow the schedule: each
    microbatch's forward, loss and backward as the stage runs them."""
    inner = pipeline.stage_module
    inner.train()
    loop = _Loop(inner, inner, args, kwargs, recorder, step, device, autocast)
    schedule = pipeline.schedule()
    stage = schedule._stage
    wrapped = [(stage, "forward_one_chunk", Phase.FORWARD), (stage, "backward_one_chunk", Phase.BACKWARD),
               (stage, "backward_weight_one_chunk", Phase.BACKWARD)]
    if pipeline.last:  # the schedule asks every stage; only the last computes a loss
        wrapped.append((schedule, "_maybe_compute_loss", Phase.LOSS))
    for owner, name, phase in wrapped:
        if hasattr(owner, name):
            setattr(owner, name, _in_phase(recorder, phase, getattr(owner, name)))
    targets: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(saving(recorder), lambda t: t), \
            _checkpointed(inner, step, recorder), pipeline_warmup_known():
        for iteration in range(step.iterations):
            recorder.iteration = iteration
            recorder.phase = Phase.FORWARD
            if pipeline.last and not targets:  # the batch's labels, kept like the data
                out = pipeline.example_out[0]
                shape = (out.shape[0] * pipeline.spec.n_microbatches, *out.shape[1:-1])
                targets.append(torch.zeros(shape, dtype=torch.int64, device=out.device))
                recorder.mark(targets[0], Role.INPUT, "targets")
            losses: list[torch.Tensor] = []
            if pipeline.first:
                schedule.step(*args, **kwargs, **({"target": targets[0], "losses": losses} if pipeline.last else {}))
            elif pipeline.last:
                schedule.step(target=targets[0], losses=losses)
            else:
                schedule.step()
            if iteration == 0:
                for info in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
                    for recv in info:
                        if isinstance(getattr(recv, "buffer", None), torch.Tensor):
                            recorder.mark(recv.buffer, Role.COMMUNICATION, "pipeline receive buffers")
            for name, p in loop.params.items():
                if p.grad is not None:
                    recorder.mark(p.grad, Role.GRADIENT, f"{name}.grad", owner=name)
            _optimizer_step(loop)
            del losses
            recorder.poll()


def _in_phase(recorder: Recorder, phase: Phase, method: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        recorder.phase = phase
        return method(*args, **kwargs)
    return run


def _micro_step(loop: _Loop) -> tuple[Any, torch.Tensor]:
    recorder, step = loop.recorder, loop.step
    recorder.phase = Phase.FORWARD
    with loop.autocast():
        out = loop.model(*loop.args, **loop.kwargs)
        recorder.phase = Phase.LOSS
        if step.loss in ("cross_entropy", "nll") and not loop.targets:
            loop.targets.append(make_targets(find_logits(out)))
            recorder.mark(loop.targets[0], Role.INPUT, "targets")
        loss = compute_loss(step.loss, out, loop.targets[0] if loop.targets else None)
    if step.grad_accum > 1:
        loss = loss / step.grad_accum
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        raise TraceError("the loss is not a scalar that requires grad; does the model have "
                         "trainable parameters on its output path? try --loss or --mode inference")
    _mark_output(recorder, (out, loss))
    recorder.phase = Phase.BACKWARD
    backward_keeping_modes(loop.scaler.scale(loss) if loop.scaler else loss)
    for name, p in loop.params.items():
        if p.grad is not None:
            recorder.mark(p.grad, Role.GRADIENT, f"{name}.grad", owner=name)
    return out, loss


def _autocast(step: StepConfig, device: torch.device, cuda: bool) -> AbstractContextManager[Any]:
    """torch.autocast for ``--amp`` on the (fake) device, or nothing.  The CUDA target records
    on fake CPU tensors, so there autocast runs with CUDA's op lists (graphmem.trace.cuda_target.autocast)."""
    if step.amp is None:
        return contextlib.nullcontext()
    if cuda:
        return cuda_autocast(AMP_DTYPES[step.amp])
    return torch.autocast(device.type, dtype=AMP_DTYPES[step.amp])


@contextlib.contextmanager
def _cuda_autocast_rules(active: bool, step: StepConfig) -> Iterator[None]:
    """For the CUDA target with --amp: CUDA's autocast lists for the whole step (checkpoint's
    recompute in backward re-enters autocast on its own, and must get CUDA's lists too)."""
    if not active or step.amp is None:
        yield
        return
    with cuda_autocast_lists():
        yield


def _optimizer_step(loop: _Loop) -> None:
    if loop.fork is not None:
        _fork_ranks(loop, loop.fork)
    recorder, opt = loop.recorder, loop.opt
    recorder.phase = Phase.OPTIMIZER
    if opt is None:
        for p in loop.params.values():
            p.grad = None
        return
    if loop.scaler is not None:
        loop.scaler.step(opt)
        loop.scaler.update()
        for key in ("_scale", "_growth_tracker"):
            value = getattr(loop.scaler, key, None)
            if isinstance(value, torch.Tensor):
                recorder.mark(value, Role.OPTIMIZER_STATE, f"grad_scaler.{key}")
    else:
        opt.step()
    state = getattr(opt, "optim", opt).state  # ZeroRedundancyOptimizer: its rank's local optimizer
    for name, p in loop.params.items():
        for key, value in state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                recorder.mark(value, Role.OPTIMIZER_STATE, f"{name}.{key}", owner=name)
    opt.zero_grad(set_to_none=True)


def _fork_ranks(loop: _Loop, fork: RankFork) -> None:
    """Where ZeRO-1's ranks start to differ: in a child, the optimizer becomes its rank's (the
    one ZeroRedundancyOptimizer builds on that rank, reading its values)."""
    rank = fork.split()
    if rank is None:
        return
    import torch.distributed as dist

    own = dist.get_rank
    dist.get_rank = lambda group=None: rank  # what the rank's optimizer asks
    try:
        loop.opt = make_optimizer(loop.step, list(loop.params.values()), zero=True)
    finally:
        dist.get_rank = own
    loop.recorder.scalar_reads = fork.reads[rank]


@contextlib.contextmanager
def _checkpointed(model: nn.Module, step: StepConfig, recorder: Recorder) -> Iterator[None]:
    """Run every ``step.checkpoint_every``-th module of the named classes under non-reentrant
    torch.utils.checkpoint; with ``step.checkpoint_save``, selectively (op outputs kept)."""
    class_names = step.checkpoint
    if not class_names:
        yield
        return
    paths = {id(m): name for name, m in model.named_modules()}
    # by the class or its direct base: FSDP2's fully_shard turns Class into FSDPClass(FSDPModule, Class)
    def names(m: nn.Module) -> set[str]:
        return {type(m).__name__, *(base.__name__ for base in type(m).__bases__)}

    found = [m for m in model.modules() if names(m) & set(class_names)]
    missing = set(class_names) - {name for m in found for name in names(m)}
    if missing:
        available = sorted({type(m).__name__ for m in model.modules()})
        raise UserInputError(f"--checkpoint: no module of class {', '.join(sorted(missing))} in the "
                             f"model; its classes are: {', '.join(available)}")
    targets = found[::step.checkpoint_every]
    context = selective_policy(step.checkpoint_save) if step.checkpoint_save else None
    for module in targets:
        module.forward = functools.partial(_checkpoint_call, module.forward,
                                           paths.get(id(module), ""), recorder, context)
    # transformers' own gradient checkpointing turns the KV cache off while training (a cache
    # filled in the forward would be appended to again by every recompute); so does this
    config: Any = getattr(model, "config", None)
    cached = getattr(config, "use_cache", None)
    if cached:
        config.use_cache = False
    try:
        yield
    finally:
        for module in targets:
            del module.forward
        if cached:
            config.use_cache = cached


def _checkpoint_call(forward: Any, path: str, recorder: Recorder, context: Callable[[], Any] | None,
                     *args: Any, **kwargs: Any) -> Any:
    def run(*inner: Any, **inner_kwargs: Any) -> Any:
        recorder.module_stack.append(path)  # names the module in the backward recompute too
        try:
            return forward(*inner, **inner_kwargs)
        finally:
            recorder.module_stack.pop()

    if context is None:
        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)
    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, context_fn=context, **kwargs)


def saving(recorder: Recorder) -> Any:
    """The pack hook: note the storage as saved for backward.

    It returns a detached alias, not the tensor itself: a saved output that held itself would
    form a reference cycle (output -> grad_fn -> saved output) that keeps it alive until the
    garbage collector runs, where the real run frees it at once.  The alias shares the
    storage, so memory is unchanged; its detach is not recorded (no real run performs it).
    The alias is watched like any tensor the recorder sees: when it is the storage's last
    holder, its death is what releases the storage.
    """
    def pack(t: torch.Tensor) -> torch.Tensor:
        recorder.mark(t, Role.SAVED)
        with recorder.silenced():
            alias = t.detach()
        recorder.mark(alias, Role.SAVED)
        return alias
    return pack


def _mark_output(recorder: Recorder, out: Any) -> None:
    leaves = out.to_tuple() if hasattr(out, "to_tuple") else out
    for leaf in tree_flatten(leaves)[0]:
        if isinstance(leaf, torch.Tensor):
            recorder.mark(leaf, Role.OUTPUT)


@contextlib.contextmanager
def _errors_explained(recorder: Recorder, model: nn.Module) -> Iterator[None]:
    """Turn exceptions raised while recording into one clear graphmem error."""
    try:
        yield
    except GraphmemError:
        raise
    except DATA_DEPENDENT_ERRORS as exc:
        raise TraceError(f"{_where(recorder, model)} reads a tensor's value: data-dependent control "
                         "flow such as `if x.sum() > 0`, .item(), or an output shape that depends on "
                         "values; graphmem runs on fake tensors that hold no values. Make that code "
                         "depend on shapes only, or declare what such a read gives with --assume reads=N "
                         "(e.g. a predicted length)") from exc
    except UnsupportedOperatorException as exc:
        raise UnsupportedError(f"{_where(recorder, model)} calls {exc}, an op with no meta/fake "
                               "implementation in this torch; graphmem cannot size it") from exc
    except RecursionError as exc:
        raise UnsupportedError(f"{_where(recorder, model)}: the model nests deeper than graphmem can record "
                               f"(Python's recursion limit, {sys.getrecursionlimit()}, was reached)") from exc
    except (RuntimeError, NotImplementedError) as exc:
        if not any(words in str(exc) for words in _DATA_ACCESS):
            raise _failed(recorder, model, exc) from exc
        raise UnsupportedError(f"{_where(recorder, model)} reads tensor memory directly ({str(exc).strip()}): "
                               ".numpy(), .tolist(), data_ptr() or a sparse layout, which fake tensors do not "
                               "have; graphmem cannot record it. Keep such code out of forward") from exc
    except Exception as exc:
        raise _failed(recorder, model, exc) from exc


@contextlib.contextmanager
def _recursion_room(frames: int = 20_000) -> Iterator[None]:
    """Recording adds Python frames to every module call (hooks, the modes): deeply nested
    models that run for real under the default limit of 1000 need more room here."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(max(before, frames))
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


# what a fake tensor says when code reaches for its memory
_DATA_ACCESS = (".numpy() is not supported", "Cannot access data pointer", "Cannot access storage",
                "data_ptr", "is not supported for tensor subclasses")


def _failed(recorder: Recorder, model: nn.Module, exc: BaseException) -> GraphmemError:
    """Any other failure: the user's inputs on the first forward, else graphmem's own limit.

    Float token ids into an embedding (``--input 8x256`` where ``8x256:int64`` was meant) get
    the input written as it should be."""
    message = f"{_where(recorder, model)} failed: {type(exc).__name__}: {str(exc).rstrip('.')}"
    if recorder.phase != Phase.FORWARD or recorder.iteration != 0:
        return TraceError(message)
    floats = [f"{'' if re.fullmatch(r'input_[0-9]+', s.label) else s.label + '='}"
              f"{'x'.join(map(str, s.shape)) or 'scalar'}:int64"
              for s in recorder.storages if Role.INPUT in s.roles and s.dtype.startswith(("float", "bfloat"))]
    if "embedding" in recorder.pending[0] and "'indices'" in str(exc) and floats:
        return UserInputError(f"{message}; token ids are integers: write the input as {' or '.join(floats)}")
    return UserInputError(f"{message}; check that --input shapes and dtypes fit the model")


def _where(recorder: Recorder, model: nn.Module) -> str:
    op, module = recorder.pending
    path = f"{type(model).__name__}.{module}" if module else type(model).__name__
    return f"{path} ({recorder.phase} phase, op {op or 'none yet'})"
