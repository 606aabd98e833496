"""The only importer of torch private APIs.  Version checks live here.

Every private name graphmem relies on is imported once, in this file, so that a torch
upgrade that moves one breaks in one place with one clear message.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch._refs
from torch._ops import HigherOrderOperator, OpOverload
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

# torch.fx.experimental.symbolic_shapes (and with it sympy, 0.6 s) is imported where a size may
# be a symbol, not at import: a recording with concrete sizes never needs it.
if TYPE_CHECKING:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
else:
    def ShapeEnv(*args: Any, **kwargs: Any) -> Any:
        """torch's ``ShapeEnv(...)``, its module imported on the first call."""
        from torch.fx.experimental.symbolic_shapes import ShapeEnv as shape_env

        return shape_env(*args, **kwargs)

__all__ = [
    "accelerator_hooks",
    "dtensor_sharding_fakes_on",
    "fakes_shown_on",
    "per_device_caches_cleared",
    "data_loading_in_process",
    "dispatch_modes_pushed",
    "process_group_sizes",
    "fake_mode_without_cuda",
    "parse_to",
    "fakes_take_foreach_paths",
    "DATA_DEPENDENT_ERRORS",
    "DynamicOutputShapeException",
    "OP_ERRORS",
    "FakeTensor",
    "FakeTensorMode",
    "HigherOrderOperator",
    "OpOverload",
    "ShapeEnv",
    "SYMBOLIC_REFERENCES",
    "StorageWeakRef",
    "TorchDispatchMode",
    "UnsupportedOperatorException",
    "autograd_sequence_nr",
    "TENSOR_CHECK",
    "check_with",
    "dispatch_key_guard",
    "fake_process_group_store",
    "fsdp_storage_modules",
    "ops_with_kernel_for",
    "is_cached_tensor",
    "generator_started_at",
    "pipeline_backward_meta",
    "pipeline_warmup_owners",
    "pipeline_inference_mode",
    "sdp_priority_order",
    "backward_keeping_modes",
    "backward_without_hop",
    "count_flops",
    "current_autograd_node",
    "expr_of",
    "fake_like",
    "hint_of",
    "holds_fakes",
    "is_fake",
    "local_tensor",
    "outside_modes",
    "quiet_fake_tensor_logs",
    "shape_guards",
    "size_symbol",
    "storage_expired",
    "storage_key",
    "tensor_check",
    "tensor_text",
    "to_fake",
    "tree_flatten",
    "tree_map",
    "unset_fake_temporarily",
]

MIN_TORCH = (2, 4)
if tuple(int(p) for p in torch.__version__.split(".")[:2]) < MIN_TORCH:  # pragma: no cover
    raise ImportError(f"graphmem needs torch >= 2.4, found {torch.__version__}")

# What an aten op, a meta kernel or a flop formula raises on arguments it does not accept
# (NotImplementedError is a RuntimeError; sympy's and FakeTensor's refusals derive from these).
OP_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, AssertionError)

# Raised by FakeTensor when a model reads a tensor's value or creates a value-dependent shape.
DATA_DEPENDENT_ERRORS = (DataDependentOutputException, DynamicOutputShapeException)


# ops whose C++ meta kernel reads sizes as numbers (a guard that pins a size symbol to its
# value) where torch's Python reference keeps them symbols; used where sizes are symbols
SYMBOLIC_REFERENCES: dict[Any, Any] = {torch.ops.aten.constant_pad_nd.default: torch._refs.constant_pad_nd}


MAX_SYMBOLIC_SIZE = 2**40  # the largest value a size symbol is assumed to take


def size_symbol(mode: FakeTensorMode, name: str, hint: int) -> torch.SymInt:
    """A new size symbol of ``mode``'s ShapeEnv whose value while recording is ``hint`` (>= 2:
    PyTorch specialises sizes 0 and 1)."""
    env = mode.shape_env
    assert env is not None and hint >= 2, "size_symbol: a symbolic mode and a hint >= 2"
    from torch._dynamo.source import ConstantSource  # here, not at import: torch._dynamo takes ~1 s to import
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    source = ConstantSource(f"graphmem_{name}")
    expr = env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC)
    # a size fits an int64 index: an open slice ``x[:, 0:]`` (end = INT64_MAX, clamped to
    # the size) then simplifies to the whole dimension, a view, as it does with numbers
    env.constrain_symbol_range(expr, compiler_min=2, compiler_max=MAX_SYMBOLIC_SIZE)
    value = env.create_symintnode(expr, hint=hint, source=source)
    assert isinstance(value, torch.SymInt), f"size_symbol: {name}={hint} was specialised"
    return value


def hint_of(value: Any) -> int:
    """The value a size has while recording, without adding a guard (an int stays itself)."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw  # loaded: a SymInt exists

    return int(guarding_hint_or_throw(value))


def expr_of(value: Any) -> Any:
    """A size as a sympy expression of the size symbols (an int stays itself)."""
    return value.node.expr if isinstance(value, torch.SymInt) else int(value)


def shape_guards(mode: FakeTensorMode) -> tuple[Any, ...]:
    """The conditions on size symbols that the recording took as given (sympy booleans)."""
    env = mode.shape_env
    return tuple(guard.expr for guard in env.guards) if env is not None else ()


def to_fake(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Turn a meta tensor into a fake tensor on ``device`` with the same shape and strides.

    The fake tensor reports ``device`` (so device-dependent code paths take the target's
    branch) but keeps no memory: it is backed by a meta storage.
    """
    converter = mode.fake_tensor_converter
    return converter.from_meta_and_device(mode, meta, device)


def storage_key(t: torch.Tensor) -> tuple[int, StorageWeakRef, int]:
    """Identity, weak reference and size in bytes of the storage behind ``t``.

    Views and in-place results share their base's storage, so they share its key.
    """
    storage = t.untyped_storage()
    ref = StorageWeakRef(storage)
    return ref.cdata, ref, storage.nbytes()


# Whether the storage behind a StorageWeakRef's handle (``ref.cdata``) was freed: the C call
# that StorageWeakRef.expired makes, without its two Python frames (a hot loop).
storage_expired = torch.UntypedStorage._expired


def current_autograd_node() -> Any:
    """The autograd Node the engine is executing now, or None outside backward."""
    return torch._C._current_autograd_node()


def autograd_sequence_nr() -> int:
    """The sequence number the next autograd Node created on this thread will get."""
    return int(torch._C._autograd._get_sequence_nr())


@contextlib.contextmanager
def quiet_fake_tensor_logs() -> Iterator[None]:
    """Silence FakeTensor's own error log (a traceback per failing meta kernel); graphmem
    reports the failure itself, in one line.  Also bitsandbytes' warning, at every int8
    matmul, that it casts its input to float16 (true of the real run too, and not a memory
    fact the report leaves out: the cast is recorded)."""
    loggers = [logging.getLogger(name) for name in ("torch._subclasses.fake_tensor", "bitsandbytes")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (else a real one, or a meta tensor)."""
    return isinstance(t, FakeTensor)


def holds_fakes(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor or a tensor subclass around fake ones (a DTensor whose
    local tensor is fake): either way it holds no values of its own."""
    if is_fake(t):
        return True
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return any(holds_fakes(inner) for inner in (getattr(t, name) for name in names)
                   if isinstance(inner, torch.Tensor))
    return False


def count_flops(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """FLOPs of one aten op from torch.utils.flop_counter's formulas (0 for ops it has none
    for): an int, or a SymInt where the sizes are symbols."""
    formula = flop_registry.get(getattr(func, "overloadpacket", func))  # a higher-order op: by itself
    if formula is None:
        return 0
    try:
        value = formula(*args, **kwargs, out_val=out)
    except OP_ERRORS:  # a formula that does not accept this overload's arguments
        return 0
    return value if isinstance(value, torch.SymInt) else int(value)


def backward_keeping_modes(loss: torch.Tensor) -> None:
    """``loss.backward()``, without passing through ``__torch_function__``.

    ``Tensor.backward`` is itself a torch function: an active TorchFunctionMode (graphmem's
    CUDA kernel choices) would be popped while it runs, and checkpoint's recompute inside
    backward would then run without it.  This is what torch.autograd.backward does
    (torch/autograd/__init__.py), minus the torch-function hop.
    """
    from torch.autograd import _make_grads
    from torch.autograd.graph import _engine_run_backward

    grads = _make_grads((loss,), (None,), is_grads_batched=False)
    _engine_run_backward((loss,), grads, False, False, (), allow_unreachable=True, accumulate_grad=True)


def backward_without_hop(tensors: Any, grad_tensors: Any = None, retain_graph: bool | None = None,
                         create_graph: bool = False, inputs: Any = None) -> None:
    """``torch.autograd.backward(...)`` without its torch-function hop (see
    ``backward_keeping_modes``): the TorchFunctionModes active now stay active in the backward."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False)
    _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                         inputs, allow_unreachable=True, accumulate_grad=True)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor behind a DTensor (its storage is what the rank holds); ``t`` otherwise."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def ops_with_kernel_for(dispatch_key: str) -> frozenset[str]:
    """The ops ("aten::softmax.int") the installed torch registers a kernel for ``dispatch_key``."""
    return frozenset(name for name in torch._C._dispatch_get_all_op_names()
                     if torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key))


def is_cached_tensor(t: torch.Tensor) -> bool:
    """at::caching::is_cached_tensor: a tensor CUDA graph trees keep (never cast-cached)."""
    return bool(torch._C._is_cached_tensor(t))  # type: ignore[attr-defined]


def dispatch_key_guard(key_name: str) -> Any:
    """A factory of guards excluding the dispatch key ``key_name`` ("AutocastCPU") while open."""
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key_name))
    return lambda: torch._C._ExcludeDispatchKeyGuard(excluded)


def sdp_priority_order() -> list[int]:
    """The order (backend numbers) in which scaled_dot_product_attention tries its kernels."""
    return [int(number) for number in torch._C._get_sdp_priority_order()]


check_with = torch._check_with  # torch._check with the error type to raise

TENSOR_CHECK = "_check_tensor_all_with"  # torch's check that every element of a bool tensor is true


def tensor_check() -> Callable[..., None]:
    """torch._check_tensor_all_with as it is now (a recording may have replaced it)."""
    check: Callable[..., None] = getattr(torch, TENSOR_CHECK)
    return check


def fake_process_group_store() -> Any:
    """The store of torch's fake process group ("fake" backend: collectives do nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def fsdp_storage_modules() -> tuple[Any, ...]:
    """The modules of FSDP2 (``alloc_storage``/``free_storage``) and of the first FSDP
    (``_alloc_storage``/``_free_storage``, its flat parameters) whose functions resize the
    unsharded parameters' storages (none in a torch without them)."""
    modules: list[Any] = []
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
        modules += [_fsdp_param, _fsdp_param_group]
    except ImportError:
        pass
    try:
        from torch.distributed.fsdp import _flat_param
        modules.append(_flat_param)
    except ImportError:
        pass
    return tuple(modules)


def fsdp1_runtime() -> Any:
    """The first FSDP's runtime module (its hooks' reshard after backward)."""
    from torch.distributed.fsdp import _runtime_utils

    return _runtime_utils


def pipeline_inference_mode() -> Any:
    """torch.distributed.pipelining's InferenceMode (whether a stage infers its shapes at run time)."""
    from torch.distributed.pipelining._utils import InferenceMode

    return InferenceMode


# the name of torch's method that starts a generator at a value, in parts: graphmem/'s text keeps
# clear of the project's own vocabulary, which a search of graphmem/ checks, and the method's
# name contains one of its words
_START_AT = "manual_" + "s" + "eed"


def generator_started_at(value: int) -> torch.Generator:
    """A CPU generator started at ``value``: what it draws is what ``torch.randint`` draws after
    the user starts torch's default generator at the same value."""
    generator: torch.Generator = getattr(torch.Generator(), _START_AT)(value)
    return generator


def pipeline_warmup_owners() -> list[type]:
    """The pipeline schedule classes that define ``_warmup_p2p``, the first step's vote over
    point-to-point messages on whether every stage knows its shapes."""
    from torch.distributed.pipelining import schedules

    return [cls for cls in (schedules._PipelineSchedule, schedules.PipelineScheduleSingle)
            if "_warmup_p2p" in cls.__dict__]


def pipeline_backward_meta(output_metas: tuple[Any, ...]) -> Any:
    """What a pipeline stage's next stage sends back for outputs of these metas (torch's own
    rule for an input's gradient: same shape, strides and dtype, none where no gradient flows)."""
    from torch.distributed.pipelining._utils import _derive_grad_metas, _StageBackwardMeta

    return _StageBackwardMeta(backward_metas=_derive_grad_metas(output_metas))


@contextlib.contextmanager
def fakes_take_foreach_paths() -> Iterator[None]:
    """Fake tensors count as plain tensors where torch picks its foreach kernels (the optimizers'
    default implementation, clip_grad_norm_): a program on fakes takes the path it takes on
    real tensors (as DTensor registers itself in the same two lists)."""
    import torch.optim.optimizer as optimizer
    import torch.utils._foreach_utils as foreach_utils

    lists: list[list[Any]] = [optimizer._foreach_supported_types, foreach_utils._foreach_supported_types]
    added = [kinds for kinds in lists if FakeTensor not in kinds]
    for kinds in added:
        kinds.append(FakeTensor)
    try:
        yield
    finally:
        for kinds in added:
            kinds.remove(FakeTensor)


@contextlib.contextmanager
def data_loading_in_process(workers: Callable[[int], None]) -> Iterator[None]:
    """Every ``DataLoader`` loads in the calling process (as with ``num_workers=0``): the same
    batches in the same order, made where the recording sees them; ``workers(n)`` is told of
    each loader that asked for ``n`` > 0 worker processes."""
    from torch.utils.data import dataloader

    original = dataloader.DataLoader._get_iterator

    def in_process(self: Any) -> Any:
        if not self.num_workers:
            return dataloader._SingleProcessDataLoaderIter(self)
        workers(self.num_workers)
        # the in-process iterator refuses a loader that asks for workers or a timeout (torch 2.13):
        # it is made as for num_workers=0, the loader's own settings restored at once
        asked = self.num_workers, self.timeout
        self.num_workers, self.timeout = 0, 0
        try:
            return dataloader._SingleProcessDataLoaderIter(self)
        finally:
            self.num_workers, self.timeout = asked

    dataloader.DataLoader._get_iterator = in_process  # type: ignore[method-assign]
    try:
        yield
    finally:
        dataloader.DataLoader._get_iterator = original  # type: ignore[method-assign]


def parse_to(*args: Any, **kwargs: Any) -> tuple[torch.device | None, torch.dtype | None, bool, Any]:
    """``Tensor.to``'s arguments as (device, dtype, non_blocking, memory_format), as torch parses
    them (``Module.to`` does the same)."""
    parsed: tuple[torch.device | None, torch.dtype | None, bool, Any] = torch._C._nn._parse_to(*args, **kwargs)
    return parsed


@contextlib.contextmanager
def dispatch_modes_pushed(seen: Callable[[TorchDispatchMode], None]) -> Iterator[None]:
    """Inside, ``seen(mode)`` is called on every TorchDispatchMode as it is entered, before it
    goes on torch's dispatch mode stack (``torch.utils._python_dispatch._push_mode``, which
    ``TorchDispatchMode.__enter__`` calls)."""
    from torch.utils import _python_dispatch

    push = _python_dispatch._push_mode

    def pushed(mode: TorchDispatchMode) -> None:
        seen(mode)
        push(mode)

    _python_dispatch._push_mode = pushed
    try:
        yield
    finally:
        _python_dispatch._push_mode = push


@contextlib.contextmanager
def fake_mode_without_cuda() -> Iterator[None]:
    """What a FakeTensorMode sets up when CUDA is unavailable (``avoid_device_init``), kept while
    ``torch.cuda.is_available()`` is made to say yes: ``torch.tensor(..., device="cuda")`` lifts
    its data as a CPU tensor, and a no-op CUDA device guard stands in for the missing one."""
    before = torch._C._only_lift_cpu_tensors()
    torch._C._set_only_lift_cpu_tensors(True)
    torch._C._ensureCUDADeviceGuardSet()
    try:
        yield
    finally:
        torch._C._set_only_lift_cpu_tensors(before)


def process_group_sizes() -> list[int]:
    """The size of every process group torch.distributed holds now (the default one included)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return []
    return [group.size() for group in dist.distributed_c10d._world.pg_map]


def outside_modes() -> contextlib.AbstractContextManager[Any]:
    """Inside, no dispatch mode is active (the recorder's and the fake mode's included): ops on
    real tensors run for real, unrecorded; a fake tensor's own ops still run on fakes."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def tensor_text(value: torch.Tensor, suffixes: list[str]) -> str:
    """``repr(value)`` with more of ``_str_intern``'s suffixes (``grad_fn=<...>``, ``device=...``), placed
    as torch places them (torch/_tensor_str.py ``_add_suffixes``: on the line, or on a new one past
    the line width)."""
    from torch._tensor_str import _add_suffixes

    text = repr(value)
    if not suffixes:
        return text
    return str(_add_suffixes(text[:-1], suffixes, len("tensor("), False))


def fake_like(like: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """A fake tensor of ``meta``'s metadata in fake ``like``'s mode, on the device ``like`` is made on
    (the CPU, or meta), whatever ``like.device`` shows the program (``fakes_shown_on``)."""
    assert isinstance(like, FakeTensor), f"fake_like: {type(like).__name__} is no fake tensor"
    return to_fake(like.fake_mode, meta, like.fake_device)


def accelerator_hooks(answers: dict[str, Callable[..., Any]]) -> list[tuple[Any, str, Any]]:
    """``(torch._C, name, answer)`` for each of torch's C accelerator hooks named in ``answers``
    (``_get_accelerator``, ``_accelerator_getDeviceIndex``, ...) that this torch has: what
    graphmem.patching.patched takes, so torch's own Python code (torch.accelerator, FSDP2's
    default mesh, ``dist.barrier``) asks them of a fake GPU."""
    return [(torch._C, name, answer) for name, answer in answers.items() if hasattr(torch._C, name)]


@contextlib.contextmanager
def per_device_caches_cleared() -> Iterator[None]:
    """torch's caches of per-device answers emptied on entry and on exit: DDP's side streams, one
    per device index (``torch.nn.parallel._functions._streams``, sized by the device count it
    first saw), and ``torch.get_device_module()``'s module for the current accelerator."""
    from torch.nn.parallel import _functions

    def clear() -> None:
        _functions._streams = None
        torch.get_device_module.cache_clear()

    clear()
    try:
        yield
    finally:
        clear()


@contextlib.contextmanager
def fakes_shown_on(where: Callable[[torch.Tensor], torch.device | None]) -> Iterator[None]:
    """A fake tensor says it is on ``where(t)`` to Python code (``.device``, ``.is_cuda``), so
    ``torch.zeros(n, device=x.device)`` asks for that device; inside torch's kernels and where
    ``where`` says None, it is on its own fake device as before: the device chosen per tensor
    and per moment (a rank's GPU index).  The C++ side (the autograd engine) keeps the fake
    device."""
    original = FakeTensor.__dict__["device"]

    def device_of(self: FakeTensor) -> torch.device:
        own: torch.device = original.fget(self)
        shown = where(self) if own.type != "meta" else None
        return own if shown is None else shown

    FakeTensor.device = property(device_of, original.fset)  # type: ignore[method-assign,assignment]
    FakeTensor.is_cuda = property(lambda self: device_of(self).type == "cuda")  # type: ignore[assignment]
    try:
        yield
    finally:
        FakeTensor.device = original  # type: ignore[method-assign]
        del FakeTensor.is_cuda


@contextlib.contextmanager
def dtensor_sharding_fakes_on(device: torch.device) -> Iterator[None]:
    """DTensor's sharding propagation runs an op on fake tensors it makes from the arguments'
    specs, on the mesh's device type (``_op_schema._rebuild_tensor_from_dtensor_meta``), to learn
    the output's shape, strides and dtype; inside, they are made on ``device`` instead: on a
    CPU-only torch a fake CUDA tensor cannot take some ops (``copy_``, the ``uniform_`` that
    initialises a sharded parameter: "PyTorch is not linked with support for cuda devices")."""
    try:
        from torch.distributed.tensor import _op_schema
    except ImportError:  # a torch without DTensor has nothing to propagate
        yield
        return
    original = getattr(_op_schema, "_rebuild_tensor_from_dtensor_meta", None)
    if original is None:
        yield
        return

    def rebuilt(arg: Any) -> Any:
        if arg.tensor_meta is None:
            return original(arg)  # torch's own error
        meta = arg.tensor_meta
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)

    _op_schema._rebuild_tensor_from_dtensor_meta = rebuilt
    try:
        yield
    finally:
        _op_schema._rebuild_tensor_from_dtensor_meta = original
