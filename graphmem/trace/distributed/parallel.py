"""Data-parallel and sharded training, by PyTorch's own engines under a fake process group.

``--parallel`` (graphmem.job.parallel) is applied to the fake model by the real
``DistributedDataParallel``, FSDP2 ``fully_shard`` and ``ZeroRedundancyOptimizer``, with
``torch.distributed`` initialised on PyTorch's fake backend (its collectives return at once
and touch no data) as one rank of ``world_size``.  The recorder then records that rank's step
like any other: the all-gathered parameters, the reduce-scatter inputs and the sharded
gradients and optimizer state are the engines' own tensors.

Three things the engines do outside the dispatcher, and how they are followed:

- FSDP2 frees and regrows the unsharded parameters by resizing their storages
  (``_fsdp_param.alloc_storage`` / ``free_storage``); both are wrapped to tell the recorder,
  which ends the storage's old lifetime and starts a new one with the new size.
- DDP allocates its gradient buckets in C++ at construction (seen here as ops, since the fake
  mode is active) and checks parameter values across ranks (no values on fake tensors:
  skipped); its all-reduce runs through a comm hook that does what the default one does
  (divide the bucket in place, all-reduce it in place) because the fake backend's future
  holds no tensor.  DDP's rebuild of its buckets at the start of the second forward (same
  sizes, in the order gradients became ready) is skipped: its transient second set of
  buckets is not modelled.
- Construction (sharding the parameters, allocating buckets) runs before the recorded step;
  what it leaves alive is live from the first op on, what it frees is not counted.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import importlib
import importlib.util
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import (
    TorchDispatchMode,
    fake_process_group_store,
    fsdp_storage_modules,
    local_tensor,
    pipeline_inference_mode,
    tree_flatten,
    unset_fake_temporarily,
)
from graphmem.errors import GraphmemError, UnsupportedError, UserInputError
from graphmem.job.parallel import ParallelSpec
from graphmem.job.spec import parse_dtype
from graphmem.patching import patched

__all__ = ["Applied", "PipelineStageModule", "apply_parallel", "ddp_on_fakes", "distinct_ranks", "fake_process_group",
           "fsdp_units",
           "following_resizes", "meta_copy", "pipeline_schedule", "pipeline_split",
           "pipeline_stage_module", "pipeline_warmup_known", "tp_plan", "zero_partition"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# DDP's check that every rank has the same parameter shapes (it reads values)
_VERIFY = "_verify_param_shape_across_processes"


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int) -> Iterator[None]:
    """``torch.distributed`` initialised on the fake backend as ``rank`` of ``world_size``."""
    import torch.distributed as dist

    if not dist.is_available():
        raise UnsupportedError("this torch build has no torch.distributed; --parallel needs it")
    store = fake_process_group_store()  # importing it registers the "fake" backend
    if dist.is_initialized():
        raise UnsupportedError("a torch.distributed process group is already initialised in this process; "
                               "--parallel runs its own fake one")
    dist.init_process_group("fake", store=store, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp_units(model: nn.Module, spec: ParallelSpec) -> tuple[str, ...]:
    """The classes FSDP2 shards as units: ``spec.units``, else the model's own
    ``_no_split_modules`` (transformers), else the class of the largest repeated child list."""
    present = {type(m).__name__ for m in model.modules()}
    if spec.units:
        missing = sorted(set(spec.units) - present)
        if missing:
            raise UserInputError(f"--fsdp-units: no module of class {', '.join(missing)} in the model; "
                                 f"its classes are: {', '.join(sorted(present))}")
        return spec.units
    declared = tuple(name for name in getattr(model, "_no_split_modules", None) or () if name in present)
    if declared:
        return declared
    best: tuple[int, str] | None = None
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        names = {type(c).__name__ for c in children}
        if len(children) >= 2 and len(names) == 1 and not isinstance(children[0], _CONTAINERS):
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, names.pop())
    return (best[1],) if best else ()


def _fsdp_signature(model: nn.Module, spec: ParallelSpec, rank: int) -> tuple[int, ...]:
    """Rows of every parameter this rank holds under FSDP2's dim-0 sharding (equal tuples: equal ranks)."""
    shards = spec.degree("fsdp")
    index = rank % shards  # the mesh is (replicate, shard): the shard index is the fast one
    rows = []
    for p in model.parameters():
        dim0 = p.shape[0] if p.dim() else 1
        chunk = -(-dim0 // shards)
        rows.append(max(0, min(chunk, dim0 - index * chunk)))
    return tuple(rows)


def zero_partition(model: nn.Module, world_size: int) -> list[list[int]]:
    """The trainable parameters (indices, in order) whose optimizer state each rank holds."""
    return _zero_partition([p.numel() for p in model.parameters() if p.requires_grad], world_size)


def _tp_signature(model: nn.Module, spec: ParallelSpec, index: int) -> tuple[int, ...]:
    """Elements of every parameter a tensor-parallel rank holds (torch.chunk's split of the
    sharded dimension: colwise shards dim 0, rowwise dim 1 of a Linear weight)."""
    tp = spec.degree("tp")
    root, plan = tp_plan(model, spec)
    sizes = []
    for name, module in root.named_modules():
        style = next((v for k, v in plan.items() if fnmatch.fnmatch(name, k)), None)
        if not isinstance(style, str) or style == "sequence_parallel":
            continue
        for pname, p in module.named_parameters(recurse=False):
            if style.startswith("rowwise") and pname == "bias":
                sizes.append(p.numel())  # replicated
                continue
            dim = 0 if style.startswith("colwise") else 1
            n = p.shape[dim] if p.dim() > dim else 1
            chunk = -(-n // tp)
            sizes.append(max(0, min(chunk, n - index * chunk)) * (p.numel() // max(n, 1)))
    return tuple(sizes)


def _zero_partition(sizes: list[int], world_size: int) -> list[list[int]]:
    """ZeroRedundancyOptimizer's partition: parameters sorted by size, largest first, each to
    the rank holding the fewest elements so far (ties: the lowest rank); indices per rank."""
    loads = [0] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        parts[rank].append(i)
        loads[rank] += sizes[i]
    return parts


def distinct_ranks(model: nn.Module, spec: ParallelSpec) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The ranks whose memory can differ: (a representative rank, every rank it stands for).

    FSDP2 ranks differ by their shards' rows (uneven dim 0); ZeroRedundancyOptimizer's by the
    parameters whose state they hold; DDP's ranks are alike.
    """
    world = spec.world_size
    tp = spec.degree("tp")
    if tp > 1:  # rank = dp index x tp + tp index
        keys: list[Any] = [(_fsdp_signature(model, spec, r // tp) if spec.shards else (),
                            _tp_signature(model, spec, r % tp)) for r in range(world)]
    elif spec.shards:
        keys = [_fsdp_signature(model, spec, r) for r in range(world)]
    elif spec.pipelined:  # every stage holds other blocks
        keys = list(range(world))
    elif "zero1" in dict(spec.degrees):
        params = [p for p in model.parameters() if p.requires_grad]
        parts = _zero_partition([p.numel() for p in params], world)
        keys = [tuple(sorted(tuple(params[i].shape) for i in part)) for part in parts]
    else:
        keys = [()] * world
    groups: dict[Any, list[int]] = {}
    for rank, key in enumerate(keys):
        groups.setdefault(key, []).append(rank)
    return tuple((ranks[0], tuple(ranks)) for ranks in groups.values())


class _Created(TorchDispatchMode):
    """Construction: every tensor the engines create, by weak reference."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.tensors.append(weakref.ref(t))
        return out

    def alive(self) -> list[torch.Tensor]:
        found = (ref() for ref in self.tensors)
        return [t for t in found if t is not None]


@dataclass(slots=True)
class Applied:
    """The model as the training loop calls it, and what construction left alive."""

    model: nn.Module                 # the module to call (DDP's wrapper, or the FSDP2 model)
    inner: nn.Module                 # the user's model, with its (sharded) parameters
    buffers: list[torch.Tensor]      # communication buffers the engines allocated (DDP's buckets)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no memory),
    for engines that change the module they are given (fully_shard changes its class)."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def apply_parallel(model: nn.Module, spec: ParallelSpec, fake_mode: Any) -> Applied:
    """Apply ``spec`` to ``model`` (whose parameters are fake; FSDP2 changes it: give it a
    ``meta_copy``) inside ``fake_mode``.

    Needs ``fake_process_group``.  The mesh is made before the fake mode is entered (it reads
    real values).
    """
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(name for name, _ in spec.degrees)
    created = _Created()
    mesh: Any = None
    tp_mesh: Any = None
    if spec.parallelize is not None:
        mesh = init_device_mesh("cpu", tuple(d for _, d in spec.degrees), mesh_dim_names=names)
        wrapped = _users_own(model, spec, mesh, fake_mode, created)
    else:
        if "tp" in names:
            two = init_device_mesh("cpu", (spec.degree("fsdp"), spec.degree("tp")), mesh_dim_names=("dp", "tp"))
            mesh, tp_mesh = (two["dp"] if spec.shards else None), two["tp"]
        elif spec.shards:
            replicate, shard = spec.degree("ddp"), spec.degree("fsdp")
            mesh = (init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
                    if replicate > 1 else init_device_mesh("cpu", (shard,)))
        with fake_mode, created, _meshes_made_for_real():
            if tp_mesh is not None:
                _tensor_parallel(model, spec, tp_mesh)
            if spec.shards:
                wrapped = _fully_shard(model, spec, mesh)
            else:
                wrapped = model if tp_mesh is not None else _ddp(model, spec)
    with fake_mode, created:
        _initialise_fsdp(wrapped)
    # what construction allocated, still holds, and is no parameter or buffer: DDP's buckets
    own = {local_tensor(t).untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    buffers = [t for t in created.alive() if t.untyped_storage()._cdata not in own and t.untyped_storage().nbytes()]
    return Applied(model=wrapped, inner=model, buffers=buffers)


def _initialise_fsdp(model: nn.Module) -> None:
    """Run FSDP2's lazy initialisation now, as part of construction, not in the first forward.

    It re-pads a rank's local shard unless it already is a view of the padded shard, which it
    checks by ``data_ptr()``: fake tensors have none, so on ranks with uneven shards it would
    copy every parameter in the recorded forward where the real run copies nothing.  Done
    here, the copy replaces the shard before the step, as the real one is.
    """
    state = getattr(model, "_get_fsdp_state", None)
    if callable(state):
        state()._lazy_init()


def _users_own(model: nn.Module, spec: ParallelSpec, mesh: Any, fake_mode: Any, created: _Created) -> nn.Module:
    """Run the user's ``parallelize(model, mesh)`` unchanged on the fake model."""
    import torch.nn.parallel.distributed as ddp_module

    fn = spec.parallelize
    if isinstance(fn, str):
        fn = _import_function(fn)
    assert callable(fn), "apply_parallel: parallelize is neither text nor callable"
    check = getattr(ddp_module, _VERIFY)
    setattr(ddp_module, _VERIFY, lambda *args, **kwargs: None)
    try:
        with fake_mode, created:
            result = fn(model, mesh)
    except GraphmemError:
        raise
    except Exception as exc:
        raise UserInputError(f"your --parallelize function {getattr(fn, '__qualname__', fn)} failed on the fake "
                             f"model: {type(exc).__name__}: {exc}") from exc
    finally:
        setattr(ddp_module, _VERIFY, check)
    wrapped = result if isinstance(result, nn.Module) else model
    if isinstance(wrapped, ddp_module.DistributedDataParallel):
        _fake_allreduce(wrapped, spec.world_size)
    return wrapped


def _import_function(text: str, option: str = "--parallelize", what: str = "function") -> Any:
    """``pkg.module:NAME`` or ``path/file.py:NAME`` -> the object; a function for --parallelize."""
    module_name, _, attr = text.rpartition(":")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(f"graphmem_user_{Path(module_name).stem}", module_name)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot read {module_name}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        found = getattr(module, attr)
    except (ImportError, AttributeError, ValueError, FileNotFoundError) as exc:
        raise UserInputError(f"cannot load {option} {text!r}: {exc}; give pkg.module:{what}") from exc
    if what == "function" and not callable(found):
        raise UserInputError(f"{option} {text!r} is not a function")
    return found


@contextlib.contextmanager
def _meshes_made_for_real() -> Iterator[None]:
    """FSDP2 on a tensor-parallel model joins the two meshes (DeviceMesh._concatenate), which
    indexes a small real tensor of ranks: outside the fake mode."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__.get("_concatenate")
    if original is None:
        yield
        return
    function = original.__func__ if isinstance(original, staticmethod) else original

    def concatenate(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return function(*args, **kwargs)

    DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh._concatenate = original  # type: ignore[method-assign]


def tp_plan(model: nn.Module, spec: ParallelSpec) -> tuple[nn.Module, dict[str, Any]]:
    """The module the tensor-parallel plan applies to, and the plan (module name -> style)."""
    plan = spec.tp_plan
    if isinstance(plan, str):
        plan = _import_function(plan, "--tp-plan", "PLAN")
        if not isinstance(plan, Mapping):
            raise UserInputError(f"--tp-plan {spec.tp_plan!r} is not a dict of module name -> style")
    if plan is not None:
        return model, dict(plan)
    config = getattr(model, "config", None)
    declared = getattr(config, "base_model_tp_plan", None)
    if not declared:
        raise UserInputError(f"--parallel tp: {type(model).__name__} has no tensor-parallel plan (no "
                             "base_model_tp_plan in its config); give one with --tp-plan file.py:PLAN, a dict "
                             "such as {'fc1': 'colwise', 'fc2': 'rowwise'}")
    return getattr(model, "base_model", model), dict(declared)


def _tp_style(style: Any) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not isinstance(style, str):
        return style
    styles: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel}
    return styles[style]()


def _tensor_parallel(model: nn.Module, spec: ParallelSpec, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    root, plan = tp_plan(model, spec)
    names = [name for name, _ in root.named_modules()]
    unmatched = [key for key in plan if not any(fnmatch.fnmatch(name, key) for name in names)]
    if unmatched:
        raise UserInputError(f"tensor-parallel plan: no module named {', '.join(unmatched)} in "
                             f"{type(root).__name__}")
    parallelize_module(root, mesh, {key: _tp_style(style) for key, style in plan.items()})


def _fully_shard(model: nn.Module, spec: ParallelSpec, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    units = fsdp_units(model, spec)
    policy = MixedPrecisionPolicy(
        param_dtype=parse_dtype(spec.param_dtype) if spec.param_dtype else None,
        reduce_dtype=parse_dtype(spec.reduce_dtype) if spec.reduce_dtype else None)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": spec.reshard_after_forward, "mp_policy": policy}
    for module in [m for m in model.modules() if type(m).__name__ in units and m is not model]:
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _ddp(model: nn.Module, spec: ParallelSpec) -> nn.Module:
    import torch.nn.parallel.distributed as ddp_module

    world = spec.world_size
    check = getattr(ddp_module, _VERIFY)
    setattr(ddp_module, _VERIFY, lambda *args, **kwargs: None)  # it reads values, which fakes lack
    try:
        wrapped = ddp_module.DistributedDataParallel(model, bucket_cap_mb=spec.bucket_mb,
                                                     gradient_as_bucket_view=spec.bucket_view)
    finally:
        setattr(ddp_module, _VERIFY, check)
    _fake_allreduce(wrapped, world)
    return wrapped


@contextlib.contextmanager
def ddp_on_fakes(world: int) -> Iterator[None]:
    """Inside, a ``DistributedDataParallel`` anyone's code builds (a program's own) is built as
    ``apply_parallel`` builds it on fakes: no value check across ranks, the default hook's
    all-reduce through a comm hook, no bucket rebuild (see the module docstring)."""
    import torch.nn.parallel.distributed as ddp_module

    cls = ddp_module.DistributedDataParallel
    build = cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        _fake_allreduce(self, world)

    with patched((ddp_module, _VERIFY, lambda *args, **kwargs: None), (cls, "__init__", init)):
        yield


def _fake_allreduce(wrapped: Any, world: int) -> None:
    """Give a DDP module the all-reduce of DDP's default hook, and no bucket rebuild."""
    import torch.distributed as dist

    def allreduce_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        # what DDP's default C++ hook does: divide in place, all-reduce in place, return the bucket
        tensor = bucket.buffer()
        tensor.div_(world)
        dist.all_reduce(tensor)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(tensor)
        return future

    allreduce_hook.__annotations__ = {}  # DDP checks the annotations are its own classes, or none
    wrapped.register_comm_hook(None, allreduce_hook)
    wrapped.reducer = _NoRebuild(wrapped.reducer)


class _NoRebuild:
    """DDP's reducer, except that it never rebuilds its buckets (that syncs values across ranks)."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


@contextlib.contextmanager
def following_resizes(resized: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call ``resized(tensor)`` after every storage resize FSDP2 makes (alloc/free of the
    unsharded parameters), while inside."""
    modules = fsdp_storage_modules()
    if not modules:  # no FSDP2 in this torch: nothing resizes
        yield
        return
    originals = {(m, name): getattr(m, name) for m in modules
                 for name in ("alloc_storage", "free_storage") if hasattr(m, name)}

    def wrap(original: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        def run(tensor: torch.Tensor) -> None:
            original(tensor)
            resized(tensor)
        return run

    for (module, name), original in originals.items():
        setattr(module, name, wrap(original))
    try:
        yield
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)


# ---------------------------------------------------------------------------------------------
# pipeline parallel (pp=N): torch.distributed.pipelining on one stage per rank


def pipeline_split(n_blocks: int, stages: int) -> list[range]:
    """The blocks of each stage: contiguous, as even as possible, the first stages one more."""
    if n_blocks < stages:
        raise UserInputError(f"--parallel pp={stages}: the model has {n_blocks} repeated blocks, fewer than "
                             "the stages; use at most that many stages")
    sizes = [n_blocks // stages + (1 if k < n_blocks % stages else 0) for k in range(stages)]
    starts = [sum(sizes[:k]) for k in range(stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


class _Cut(Exception):
    """Raised by the first stage's last block: its output is the stage's output."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


def _cut(module: nn.Module, args: Any, output: Any) -> None:
    raise _Cut(output)


class PipelineStageModule(nn.Module):
    """One rank's stage, running only its part of the model.

    ``model`` is a copy of the model in which every module this stage does not own is an
    ``nn.Identity`` (no parameters).  The first stage runs the model's own forward and stops
    at the output of its last block (a hook raises); the other stages run their blocks in
    order on the received activation, and the last one then the modules the model's forward
    calls after its last block (checked to be a chain: each takes the previous one's output).
    """

    def __init__(self, model: nn.Module, blocks: list[nn.Module], after: list[nn.Module],
                 first: bool, last: bool) -> None:
        super().__init__()
        self.model = model
        self.first, self.last = first, last
        # not registered as children: they are the model's own modules (paths stay model.*)
        self.__dict__["_stage_blocks"] = blocks
        self.__dict__["_stage_after"] = after
        if first and not last:
            blocks[-1].register_forward_hook(_cut)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.first:
            if self.last:
                return self.model(*args, **kwargs)
            try:
                self.model(*args, **kwargs)
            except _Cut as cut:
                output = cut.output
            else:
                raise UnsupportedError("pipeline stage 0: the model's forward did not reach its last block")
            return output
        (x,) = args
        for module in [*self.__dict__["_stage_blocks"], *(self.__dict__["_stage_after"] if self.last else ())]:
            x = module(x)
        return x


@dataclass(slots=True)
class _Probe:
    """What one forward of the whole model on a microbatch shows: the blocks' outputs, the
    modules called after the last block, and the model's output."""

    outputs: dict[int, Any]
    after: list[tuple[nn.Module, Any, Any, Any]]   # (module, args, kwargs, output) of top-level calls
    block_inputs: dict[int, tuple[Any, Any]]       # block index -> (args, kwargs)
    output: Any


def _probe(model: nn.Module, blocks: list[nn.Module], args: list[Any], kwargs: dict[str, Any]) -> _Probe:
    index = {id(b): i for i, b in enumerate(blocks)}
    probe = _Probe({}, [], {}, None)
    depth = [0]

    def pre(module: nn.Module, a: Any, kw: Any) -> None:
        if id(module) in index:
            probe.block_inputs[index[id(module)]] = (a, kw)
        depth[0] += 1

    def post(module: nn.Module, a: Any, kw: Any, out: Any) -> None:
        depth[0] -= 1
        if id(module) in index:
            probe.outputs[index[id(module)]] = out
        elif len(probe.outputs) == len(blocks) and depth[0] == 1 and module is not model:
            probe.after.append((module, a, kw, out))

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in model.modules()]
    handles += [m.register_forward_hook(post, with_kwargs=True) for m in model.modules()]
    try:
        with torch.no_grad():
            probe.output = model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return probe


def _is_chain(calls: list[tuple[Any, Any]], first_input: Any) -> bool:
    """Every call takes exactly the previous output (one positional tensor, no tensor keywords)."""
    previous = first_input
    for (a, kw), out in calls:
        if len(a) != 1 or a[0] is not previous or any(isinstance(v, torch.Tensor) for v in kw.values()):
            return False
        previous = out
    return True


def _replace(model: nn.Module, target: nn.Module) -> None:
    """Put an nn.Identity wherever ``target`` sits in ``model``."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if child is target:
                module._modules[name] = nn.Identity()


def pipeline_stage_module(model: nn.Module, spec: ParallelSpec, rank: int, fake_mode: Any,
                          args: list[Any], kwargs: dict[str, Any]) -> tuple[PipelineStageModule, Any, Any]:
    """Stage ``rank`` of ``model`` (a copy it may change: its unowned modules become
    nn.Identity) and example (input, output) of one microbatch for ``PipelineStage``.

    The blocks are the modules of the classes ``fsdp_units`` names (the model's repeated
    blocks), cut by ``pipeline_split``; what the forward runs before the first block goes with
    stage 0, what it runs after the last block with the last stage.
    """
    stages = spec.degree("pp")
    units = fsdp_units(model, spec)
    blocks: list[nn.Module] = []
    for m in model.modules():
        if type(m).__name__ in units and m is not model and not any(m in set(b.modules()) for b in blocks):
            blocks.append(m)
    if not blocks:
        raise UserInputError(f"--parallel pp: {type(model).__name__} has no repeated blocks to cut into stages; "
                             "name their class with --fsdp-units")
    split = pipeline_split(len(blocks), stages)
    mine = split[rank]
    first, last = rank == 0, rank == stages - 1
    microbatch = _first_microbatch(args, kwargs, spec.n_microbatches)
    with fake_mode:
        probe = _probe(model, blocks, *microbatch)
    if len(probe.outputs) != len(blocks):
        raise UnsupportedError(f"--parallel pp: the forward of {type(model).__name__} does not call each of its "
                               f"{len(blocks)} blocks once")
    ordered = [probe.block_inputs[i] for i in range(len(blocks))]
    after_calls = [((a, kw), out) for _, a, kw, out in probe.after]
    if not _is_chain([(ordered[i], probe.outputs[i]) for i in range(1, len(blocks))], probe.outputs[0]) or \
            not _is_chain(after_calls, probe.outputs[len(blocks) - 1]) or \
            (after_calls and probe.output is not after_calls[-1][1]) or \
            (not after_calls and probe.output is not probe.outputs[len(blocks) - 1]):
        raise UnsupportedError(f"--parallel pp: {type(model).__name__} is not a chain after its first block (each "
                               "block, then each module after the last, taking only the previous output); "
                               "graphmem cannot run one of its stages on its own")
    after = [module for module, _, _, _ in probe.after]
    own = {id(m) for i in mine for m in blocks[i].modules()}
    if last:
        own |= {id(m) for a in after for m in a.modules()}
    dropped = [b for i, b in enumerate(blocks) if i not in mine]
    if not last:
        dropped += after
    for module in dropped:
        _replace(model, module)
    if not first:  # what runs before the first block: every parametrised module no longer needed
        kept = {id(m) for m in model.modules() if id(m) in own}
        for module in list(model.modules()):
            if module is not model and id(module) not in kept and \
                    not any(id(m) in kept for m in module.modules()) and \
                    (any(True for _ in module.parameters(recurse=False)) or
                     any(True for _ in module.buffers(recurse=False))):
                _replace(model, module)
    stage = PipelineStageModule(model, [blocks[i] for i in mine], after, first, last)

    def like(t: Any, grad: bool) -> Any:
        with fake_mode:
            return torch.empty(t.shape, dtype=t.dtype, device=t.device, requires_grad=grad)

    if first:
        example_in = tuple(a for a in microbatch[0] if isinstance(a, torch.Tensor))
    else:
        example_in = (like(probe.outputs[mine[0] - 1], False),)
    out = probe.output if last else probe.outputs[mine[-1]]
    if not isinstance(out, torch.Tensor):
        raise UnsupportedError("--parallel pp: a stage's output must be one tensor")
    return stage, example_in, (like(out, not last),)


def _first_microbatch(args: list[Any], kwargs: dict[str, Any], n: int) -> tuple[list[Any], dict[str, Any]]:
    """The first of ``n`` microbatches: every tensor's dim 0 split evenly, as the schedule splits it."""
    def chunk(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.shape[0] % n:
            raise UserInputError(f"--microbatches {n}: the batch ({t.shape[0]}, dim 0 of the inputs) must be a "
                                 "multiple of the microbatches")
        return t[: t.shape[0] // n]
    return [chunk(a) for a in args], {k: chunk(v) for k, v in kwargs.items()}


def pipeline_schedule(stage_module: nn.Module, spec: ParallelSpec, rank: int, example_in: Any, example_out: Any,
                      loss_fn: Callable[[Any, Any], torch.Tensor]) -> Any:
    """``PipelineStage`` on the stage module and the schedule ``spec.schedule`` over it (needs
    the fake process group; the stage's shapes are given, so no shape inference is run)."""
    from torch.distributed import pipelining

    device = next(iter(stage_module.parameters()), torch.empty(0)).device
    stage = pipelining.PipelineStage(stage_module, rank, spec.degree("pp"), device,
                                     input_args=example_in, output_args=example_out)
    cls = getattr(pipelining, {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}[spec.schedule])
    return cls(stage, spec.n_microbatches, loss_fn=loss_fn)


@contextlib.contextmanager
def pipeline_warmup_known() -> Iterator[None]:
    """The schedules' first step votes, over point-to-point messages, whether every stage was
    given its shapes, and reads the vote's value (``.item()``): no values on the fake process
    group.  Every stage here is given its shapes, so each stage is told the vote's outcome."""
    from torch.distributed.pipelining import schedules
    InferenceMode = pipeline_inference_mode()

    def warmup(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise UnsupportedError("--parallel pp: a stage needs shape inference at run time")
            stage._inference_mode = InferenceMode.STATIC

    targets = [cls for cls in (schedules._PipelineSchedule, schedules.PipelineScheduleSingle)
               if "_warmup_p2p" in cls.__dict__]
    saved = {cls: cls.__dict__["_warmup_p2p"] for cls in targets}
    for cls in targets:
        setattr(cls, "_warmup_p2p", warmup)  # noqa: B010 (a method replaced while inside)
    try:
        yield
    finally:
        for cls, value in saved.items():
            setattr(cls, "_warmup_p2p", value)  # noqa: B010
