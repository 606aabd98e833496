"""Per-rank ground truth for data-parallel training: run it for real with gloo on CPU, count storages.

Independent of graphmem's code (imports nothing from ``graphmem``).  ``world_size`` processes are
spawned (torch.multiprocessing, "spawn", OMP_NUM_THREADS=1); each runs the training step for real
while a TorchDispatchMode counts the bytes of its live tensor storages after every aten op: the
method of ``tests/oracles.py`` (``LiveStorages``), extended for distributed runs ("Counting" below).
Networking: the ranks meet through a FileStore in the run's temporary directory and gloo connects
them over 127.0.0.1 only (TCPStore is not used: its server listens on every interface).

Set-up, identical on every rank:
    torch.manual_seed(0); model = build(); model.train()
    torch.manual_seed(1000 + rank); inputs = tests.oracles.real_inputs(inputs, int_high)
    (each rank its own local batch, same shapes; the values never change memory here)

Strategies, applied exactly like this (the predictor applies them identically):
    "ddp":   model = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb,
                                             gradient_as_bucket_view=gradient_as_bucket_view)
             opt = tests.oracles.OPTIMIZERS[optimizer]([p for p in model.parameters() if p.requires_grad])
    "fsdp":  FSDP2.  mesh = init_device_mesh("cpu", (world_size,)), made before the model and before
             counting starts (its rank tensor, world_size int32, is communication set-up like the
             process group: not counted).  kwargs = dict(mesh=mesh,
             reshard_after_forward=reshard_after_forward), plus mp_policy=MixedPrecisionPolicy(
             param_dtype=..., reduce_dtype=...) only when param_dtype or reduce_dtype is given
             ("bfloat16", "float16", "float32"; the one not given is None).  fully_shard(m, **kwargs)
             on every submodule whose class name is in ``units`` (collected in model.modules() order
             before any is sharded; the root is not among them), then fully_shard(model, **kwargs).
             opt = OPTIMIZERS[optimizer]([p for p in model.parameters() if p.requires_grad])  (DTensors)
    "tp":    tensor parallel.  mesh = init_device_mesh("cpu", (world_size,)); parallelize_module(model, mesh,
             {name: ColwiseParallel() or RowwiseParallel() as tp_plan names them}); with no tp_plan, a
             transformers model's config.base_model_tp_plan on model.base_model; the optimizer as "fsdp".
    "hsdp":  HSDP: "fsdp" on mesh = init_device_mesh("cpu", (world_size // tp_degree, tp_degree),
             mesh_dim_names=("replicate", "shard")) (tp_degree is the shard degree here).
    "fsdp_tp": 2-D.  mesh = init_device_mesh("cpu", (world_size // tp_degree, tp_degree),
             mesh_dim_names=("dp", "tp")); parallelize_module on mesh["tp"] as "tp", then "fsdp" on mesh["dp"].
    "zero1": DDP as above, then opt = torch.distributed.optim.ZeroRedundancyOptimizer(
             model.parameters(), optimizer_class=cls, **kwargs) with (cls, kwargs) =
             ZERO_OPTIMIZERS[optimizer], the class and arguments of tests.oracles.OPTIMIZERS.
    "pp":    pipeline parallel, rank r = stage r of world_size.  model = pp_stage(model, r, world_size),
             a hand-written stage builder (``gpt_stage``: the blocks cut into world_size contiguous runs,
             the first stages one block more when uneven; embeddings with stage 0, final norm and head
             with the last; the other modules dropped with the full model).  stage = PipelineStage(
             model, r, world_size, cpu, input_args=..., output_args=...) with the shapes of one
             microbatch as meta tensors (the first stage's output requires grad); schedule =
             ScheduleGPipe / Schedule1F1B(stage, microbatches, loss_fn=loss of (output, target)).
             opt = OPTIMIZERS[optimizer](the stage's parameters).  The step, per iteration:
             stage 0: schedule.step(*inputs); the last: schedule.step(target=targets, losses=losses);
             others: schedule.step(); then opt.step(); opt.zero_grad(set_to_none=True); ``losses`` is
             held until then.  targets: int64 zeros shaped like the whole batch's logits[..., 0], made
             by the last rank at the start of its first step (for every loss kind: the batch's labels).
             Phases: "forward" at the start of each step and in every forward_one_chunk,
             "backward" in every backward_one_chunk (gradient scaling at the end included), "loss" in
             the last stage's _maybe_compute_loss, "optimizer".  The schedule's first step runs its
             P2P warm-up vote for real (4-byte tensors) and allocates its receive buffers: counted.

The step, per iteration, in a function whose locals die at its return (as tests/oracles.py):
    out = model(*inputs); loss = loss_fn(out); loss.backward(); opt.step();
    opt.zero_grad(set_to_none=True)        # out and loss are held until after the optimizer step
Phases: "forward" (model(*inputs), FSDP's all-gathers and DDP's bucket rebuild included), "loss",
"backward" (DDP's all-reduces, FSDP's reduce-scatters included), "optimizer" (step and zero_grad,
ZeRO's parameter broadcasts included).  The targets of "cross_entropy"/"nll" are made at the first
loss and stay alive, as in tests/oracles.py.

Counting (what this oracle adds to tests/oracles.py):
  * The counter is entered BEFORE the strategy is applied; the model's parameters, buffers and
    the inputs are registered first.  Every storage that an aten op sees or returns on the main
    thread is tracked, including the storages the engines allocate from C++: their ``at::empty``
    goes through the dispatcher and reaches the mode like a Python op (DDP's Reducer allocating its
    gradient buckets at construction and re-allocating them at the start of the second forward).
    tests/integration/test_dist_oracle.py checks it: DDP's start = parameters + buckets + inputs,
    the buckets being as many bytes as the parameters.
  * ``start_bytes`` is taken after the strategy and the optimizer are built, just before the first
    iteration; ``peak_bytes`` and ``phase_peaks`` cover the iterations only.  What construction
    allocates and releases (FSDP's unsharded originals, DDP's broadcast temporaries) does not count.
    The first fully_shard call leaves some of its frames in a reference cycle that holds its
    unit's original parameters, so gc.collect() runs before start_bytes is taken; the cyclic
    collector is then off during the iterations (a warning says if the iterations left storages in
    reference cycles; LAST_DETAILS[rank]["cyclic_bytes"]).
  * A tensor subclass (DTensor, any traceable wrapper subclass) counts by its inner tensors'
    storages (a DTensor by its local shard), never by its global shape.
  * Sizes are re-read from every tracked storage after every op (``storage.nbytes()``), so FSDP2's
    ``untyped_storage().resize_(0)`` / ``resize_(size)`` (``free_storage`` / ``alloc_storage``),
    which are not aten ops, are followed.
  * Collectives finish in program order: every ``c10d`` and ``_c10d_functional`` op the mode sees (including those DDP's
    Reducer launches from C++ in backward) is drained before the program goes on.  The gloo group is
    built with ONE worker thread (``_threads = 1``, device 127.0.0.1), and after the op a tiny
    all-reduce on a tensor the mode never sees is run and waited for: the worker runs its queue in
    order, so the collective is complete AND the worker has dropped its reference to it (and to its
    tensors) before the program continues.  Without this, the worker thread drops the last reference
    to a finished collective's tensors at a moment of its own and peaks vary from run to run.
    (A barrier does not do: gloo's barrier keeps weak references to the work before it, which keep
    that work's tensors alive until the barrier itself is released, again on the worker thread.)
  * ``Work.wait()`` runs with the dispatch modes off: gloo's reduce-scatter clones its input inside
    the c10d op and copies the rank's chunk out inside ``wait()``; that input-sized clone is gloo's
    (NCCL has none) and is not counted.  Also outside the count: gloo's all-gather output-sized flat
    buffer (made on its worker thread), gloo's transport buffers, and anything inside a C++ kernel.

Debugging: DIST_ORACLE_TRACE=1 prints rank 0's live bytes at every op that changes them (=all: at
every op); DIST_ORACLE_DEBUG=1 prints each rank's live storages (bytes, first op) at start.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import os
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from tests.oracles import OPTIMIZERS, LiveStorages, _loss, count_optimizer_steps, real_inputs

TIMEOUT_S = 120.0
# per rank, of the last measure_distributed call: the RankMeasured fields and "collectives" (c10d ops
# drained), "cyclic_bytes" (see the module docstring), "ddp_bucket_bytes" (the Reducer's buckets at the end)
LAST_DETAILS: list[dict[str, Any]] = []
HOST = "127.0.0.1"
PHASES = ("forward", "loss", "backward", "optimizer")
# point-to-point ops (pipeline parallel): not drained; their peer is not running the same op at once
_POINT_TO_POINT = re.compile(r"c10d\.(send|recv)")
# functional collectives (tensor parallel's all-reduce) are drained too; their wait is not a collective
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_NOT_DRAINED = re.compile(r"c10d\.(send|recv)|wait_tensor")

# ZeroRedundancyOptimizer's optimizer_class and kwargs: those of tests.oracles.OPTIMIZERS
ZERO_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {}),
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
}

MP_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32}


@dataclass(frozen=True)
class RankMeasured:
    rank: int
    peak_bytes: int                 # peak live bytes during the training iterations
    phase_peaks: dict[str, int]     # "forward", "loss", "backward", "optimizer"
    start_bytes: int                # live bytes when the first iteration starts (strategy applied)


# ---------------------------------------------------------------------------------------------
# small parameterised models for the build strings ("tests.dist_oracles:small_gpt")


def small_gpt() -> torch.nn.Module:
    """tests.models.GPT(vocab=100, dim=64, layers=2, heads=4, max_seq=64); input 2x16:int64."""
    from tests.models import GPT
    return GPT(vocab=100, dim=64, layers=2, heads=4, max_seq=64)


def small_llama() -> torch.nn.Module:
    """A 2-layer Llama from a local config (transformers; no download); input 2x16:int64."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config)


def gpt_stage(model: torch.nn.Module, stage: int, stages: int) -> torch.nn.Module:
    """Stage ``stage`` of tests.models.GPT, written by hand as a pipeline trainer writes it."""
    n = len(model.blocks)
    sizes = [n // stages + (1 if k < n % stages else 0) for k in range(stages)]
    start = sum(sizes[:stage])
    return _GPTStage(model, list(range(start, start + sizes[stage])), stage == 0, stage == stages - 1)


class _GPTStage(torch.nn.Module):
    def __init__(self, gpt: torch.nn.Module, blocks: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok, self.pos = gpt.tok, gpt.pos
        self.blocks = torch.nn.ModuleList(gpt.blocks[i] for i in blocks)
        if last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok(x) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def gpt_stage_shapes(batch: int, seq: int, stage: int, stages: int) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(input, output) of one microbatch of small_gpt's stage: (shape, dtype, requires_grad)."""
    hidden = ((batch, seq, 64), torch.float32)
    first_in = ((batch, seq), torch.int64)
    return ((first_in if stage == 0 else hidden) + (False,),
            (((batch, seq, 100), torch.float32) if stage == stages - 1 else hidden) + (stage != stages - 1,))


def uneven_mlp() -> torch.nn.Module:
    """tests.models.MLP((999, 501, 99)): dim 0 of every parameter is odd, so FSDP pads its shards."""
    from tests.models import MLP
    return MLP((999, 501, 99))


# ---------------------------------------------------------------------------------------------
# the counter


class DistLiveStorages(LiveStorages):
    """LiveStorages that follows storage resizes, counts subclasses by inner storages, drains collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives = 0
        self._drain_tensors: dict[int, tuple[Any, torch.Tensor]] = {}
        self.origin: dict[int, str] = {}  # storage key -> the op that first showed it ("registered")
        self.current = "registered"
        trace = os.environ.get("DIST_ORACLE_TRACE", "")
        self.trace: list[str] | None = [] if trace else None
        self.trace_all = trace == "all"
        self.last = 0

    def add(self, t: Any) -> None:
        """Track t's storage (a wrapper subclass's inner storages) from now until it is freed."""
        if not isinstance(t, torch.Tensor):
            return
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            for name in names:
                self.add(getattr(t, name))
            return
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse / nested layouts: none in the matrix
            return
        ref = StorageWeakRef(storage)
        old = self.refs.get(ref.cdata)
        if old is None or old[0].expired():
            self.refs[ref.cdata] = (ref, storage.nbytes())
            self.origin[ref.cdata] = self.current

    def forget_dead(self) -> None:
        for key in [k for k, (ref, _) in self.refs.items() if ref.expired()]:
            del self.refs[key]
            self.origin.pop(key, None)

    def live_bytes(self) -> int:
        """Bytes of the live tracked storages, each re-read now (resize_ is not an aten op)."""
        total = 0
        for key in list(self.refs):
            ref, _ = self.refs[key]
            storage = None if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(key)
            if storage is None:
                del self.refs[key]
                self.origin.pop(key, None)
                continue
            total += storage.nbytes()
            del storage
        return total

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.forget_dead()  # before this op may reuse the addresses of the dead
        self.current = f"{self.phase}:{func}"
        for t in tree_flatten((args, kwargs))[0]:
            self.add(t)
        out = func(*args, **kwargs)
        leaves = tree_flatten(out)[0]
        for t in leaves:
            self.add(t)
        if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES and not _NOT_DRAINED.search(str(func)):
            self._drain(tree_flatten((args, kwargs))[0])
        self.ops += 1
        now = self.live_bytes()
        if self.trace is not None and (now != self.last or self.trace_all):
            self.trace.append(f"{self.phase:9} {now - self.last:+12d} {now:12d} {func}")
        self.last = now
        self.peak = max(self.peak, now)
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), now)
        return out

    def _drain(self, arg_leaves: list[Any]) -> None:
        """Make the collective just launched finish, and gloo's worker let go of it, before going on.

        The group's single worker runs its queue in order, so once a tiny all-reduce enqueued now
        has completed, the collective has completed and the worker has dropped its reference to
        it: its tensors are then held only by the program, on this thread.  The tiny tensor is
        made here, where this mode is off, so it is never counted.
        """
        import torch.distributed as dist

        group = None
        for leaf in arg_leaves:
            if isinstance(leaf, torch.ScriptObject):
                with contextlib.suppress(Exception):
                    group = dist.ProcessGroup.unbox(leaf)
                    break
        group = group or dist.distributed_c10d._get_default_group()
        key = id(group)
        if key not in self._drain_tensors:
            self._drain_tensors[key] = (group, torch.zeros(1))
        _, tiny = self._drain_tensors[key]
        group.allreduce([tiny]).wait()
        self.collectives += 1

    def live(self) -> list[tuple[int, str]]:
        """(bytes, origin) of every live tracked storage, largest first: for debugging a count."""
        rows = []
        for key in list(self.refs):
            storage = torch.UntypedStorage._new_with_weak_ptr(key)
            if storage is not None and not self.refs[key][0].expired():
                rows.append((storage.nbytes(), self.origin.get(key, "?")))
        return sorted(rows, reverse=True)

    def reset_peaks(self) -> None:
        self.peak = 0
        self.phase_peaks = {}


# ---------------------------------------------------------------------------------------------
# one rank


def _resolve(build: str) -> Callable[[], torch.nn.Module]:
    module_name, _, attr = build.partition(":")
    if not attr:
        raise ValueError(f"build must be 'package.module:callable', got {build!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _one_worker_gloo() -> None:
    """Make every gloo group built by init_process_group/new_group use one worker thread, on 127.0.0.1."""
    from torch.distributed import distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "_graphmem_oracle", False):
        return

    class OneWorkerGloo(base):  # type: ignore[misc, valid-type]
        _graphmem_oracle = True

        def __init__(self, store: Any, rank: int, size: int,
                     timeout: datetime.timedelta = datetime.timedelta(seconds=60), **newer: Any) -> None:
            # newer torch passes more (2.14: enable_reconfigure), which the options given here replace
            options = base._Options()
            options._timeout = timeout
            options._threads = 1
            options._devices = [base.create_device(hostname=HOST)]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = OneWorkerGloo


def _quiet_waits() -> None:
    """Run Work.wait() with dispatch modes off: what gloo does inside a wait is not the program's.

    gloo's reduce-scatter clones its input (inside the c10d op, where the mode is off), all-reduces
    the clone and copies the rank's chunk to the output inside ``wait()``; NCCL allocates nothing of
    the kind.  Hiding the wait keeps gloo's clone out of the count (see the module docstring).
    """
    import torch.distributed as dist
    from torch.utils._python_dispatch import _disable_current_modes

    work = dist.distributed_c10d.Work
    if getattr(work, "_graphmem_oracle", False):
        return
    original = work.wait

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return original(self, *args, **kwargs)

    work.wait = wait
    work._graphmem_oracle = True


def _apply_strategy(model: torch.nn.Module, cfg: dict[str, Any],
                    mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    strategy = cfg["strategy"]
    if strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_cap_mb"],
                                        gradient_as_bucket_view=cfg["gradient_as_bucket_view"])
        if strategy == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            cls, kwargs = ZERO_OPTIMIZERS[cfg["optimizer"]]
            return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)
    elif strategy in ("fsdp", "tp", "fsdp_tp", "hsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        if strategy in ("tp", "fsdp_tp"):
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
            styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
            tp_mesh = mesh["tp"] if strategy == "fsdp_tp" else mesh
            if cfg["tp_plan"]:
                parallelize_module(model, tp_mesh, {k: styles[v]() for k, v in cfg["tp_plan"].items()})
            else:  # a transformers model's own plan, on its base model (what parallelize_module is given)
                plan = model.config.base_model_tp_plan
                parallelize_module(model.base_model, tp_mesh, {k: styles[v]() for k, v in plan.items()})
            if strategy == "tp":
                return model, OPTIMIZERS[cfg["optimizer"]]([p for p in model.parameters() if p.requires_grad])
            mesh = mesh["dp"]
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": cfg["reshard_after_forward"]}
        if cfg["param_dtype"] is not None or cfg["reduce_dtype"] is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=MP_DTYPES[cfg["param_dtype"]] if cfg["param_dtype"] else None,
                reduce_dtype=MP_DTYPES[cfg["reduce_dtype"]] if cfg["reduce_dtype"] else None)
        if cfg.get("shard"):  # the user's own function (an emitted policy's apply_fsdp): it shards the model
            model = _resolve(cfg["shard"])(model, mesh)
            return model, OPTIMIZERS[cfg["optimizer"]]([p for p in model.parameters() if p.requires_grad])
        units = [m for m in model.modules() if m is not model and type(m).__name__ in cfg["units"]]
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
    else:
        raise ValueError(f"unknown strategy {strategy!r} (ddp, fsdp, zero1, tp, fsdp_tp)")
    return model, OPTIMIZERS[cfg["optimizer"]]([p for p in model.parameters() if p.requires_grad])


def _uncounted_mesh_joins() -> None:
    """FSDP2 joins, slices and flattens device meshes (DeviceMesh._concatenate, __getitem__,
    _flatten), making small tensors of ranks: CPU-side bookkeeping like every mesh, never device
    memory: not counted."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._python_dispatch import _disable_current_modes

    def uncounted(method: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with _disable_current_modes():
                return method(*args, **kwargs)
        return run

    DeviceMesh._concatenate = staticmethod(uncounted(DeviceMesh._concatenate))
    for name in ("__getitem__", "_flatten"):
        if hasattr(DeviceMesh, name):
            setattr(DeviceMesh, name, uncounted(getattr(DeviceMesh, name)))


def _measure_rank(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    mesh = None
    if cfg["strategy"] in ("fsdp", "tp"):  # communication set-up, like the process group: made before counting
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (cfg["world_size"],))
    elif cfg["strategy"] == "hsdp":  # FSDP2 on a 2-D mesh: (replicate, shard), shard the fast dimension
        from torch.distributed.device_mesh import init_device_mesh
        shard = cfg["tp_degree"]
        mesh = init_device_mesh("cpu", (cfg["world_size"] // shard, shard), mesh_dim_names=("replicate", "shard"))
        _uncounted_mesh_joins()
    elif cfg["strategy"] == "fsdp_tp":  # 2-D: (dp, tp) with tp the fast dimension
        from torch.distributed.device_mesh import init_device_mesh
        tp = cfg["tp_degree"]
        two = init_device_mesh("cpu", (cfg["world_size"] // tp, tp), mesh_dim_names=("dp", "tp"))
        mesh = {"dp": two["dp"], "tp": two["tp"]}  # sliced now: the slices' rank tensors are set-up too
        _uncounted_mesh_joins()
    torch.manual_seed(0)
    model = _resolve(cfg["build"])()
    model.train()
    torch.manual_seed(1000 + rank)
    inputs = real_inputs(cfg["inputs"], cfg["int_high"])
    counter = DistLiveStorages()
    for t in [*model.parameters(), *model.buffers(), *inputs]:
        counter.add(t)
    targets: list[torch.Tensor] = []

    with counter:
        counter.phase = "setup"
        if cfg["strategy"] == "pp":
            model, opt, one_step = _pipeline(model, cfg, rank, inputs, counter)
        else:
            model, opt = _apply_strategy(model, cfg, mesh)

        def plain_step() -> None:
            counter.phase = "forward"
            out = model(*inputs)
            counter.phase = "loss"
            value = _loss(out, cfg["loss"], targets)
            counter.phase = "backward"
            value.backward()
            counter.phase = "optimizer"
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out, value

        if cfg["strategy"] != "pp":
            one_step = plain_step
        del plain_step
        # The first fully_shard call leaves its frames in a reference cycle that holds the unit's
        # original parameters: collect them now, then keep the cyclic collector from freeing
        # anything at a moment of its choosing during the iterations.
        gc.collect()
        gc.disable()
        start_bytes = counter.live_bytes()
        if os.environ.get("DIST_ORACLE_DEBUG"):
            print(f"rank {rank} live at start:", counter.live(), flush=True)
        counter.reset_peaks()
        try:
            for _ in range(cfg["iterations"]):
                one_step()
            del one_step
            before = counter.live_bytes()
            gc.collect()
            cyclic_bytes = before - counter.live_bytes()  # storages that only the cyclic collector frees
        finally:
            gc.enable()
    bucket_bytes = None
    reducer = getattr(model, "reducer", None)
    if reducer is not None:  # DDP's own account of its buckets (zeros like them: outside the count)
        bucket_bytes = sum(b.buffer().nbytes for b in reducer._get_zeros_like_grad_buckets())
    if counter.trace is not None and rank == 0:
        print("\n".join(counter.trace), flush=True)
    return {"rank": rank, "peak_bytes": counter.peak, "phase_peaks": dict(counter.phase_peaks),
            "start_bytes": start_bytes, "collectives": counter.collectives, "cyclic_bytes": cyclic_bytes,
            "ddp_bucket_bytes": bucket_bytes}


def _pipeline(model: torch.nn.Module, cfg: dict[str, Any], rank: int, inputs: list[torch.Tensor],
              counter: DistLiveStorages) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """Pipeline parallel: this rank's stage, PipelineStage, the schedule, the step (module docstring)."""
    from torch.distributed import pipelining

    world, micro = cfg["world_size"], cfg["microbatches"]
    first, last = rank == 0, rank == world - 1
    stage_module = _resolve(cfg["pp_stage"])(model, rank, world)
    del model  # the other stages' modules die with it
    batch, seq = inputs[0].shape[:2]
    (in_shape, in_dtype, _), (out_shape, out_dtype, out_grad) = _resolve(cfg["pp_shapes"])(
        batch // micro, seq, rank, world)
    stage = pipelining.PipelineStage(
        stage_module, rank, world, torch.device("cpu"),
        input_args=(torch.empty(in_shape, dtype=in_dtype, device="meta"),),
        output_args=(torch.empty(out_shape, dtype=out_dtype, device="meta", requires_grad=out_grad),))

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _loss(output, cfg["loss"], [target])

    cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[cfg["schedule"]]
    schedule = cls(stage, micro, loss_fn=loss_fn)
    _told_the_vote(schedule)

    def phase(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            counter.phase = name
            return method(*args, **kwargs)
        return run

    stage.forward_one_chunk = phase("forward", stage.forward_one_chunk)
    stage.backward_one_chunk = phase("backward", stage.backward_one_chunk)
    stage.backward_weight_one_chunk = phase("backward", stage.backward_weight_one_chunk)
    if last:
        schedule._maybe_compute_loss = phase("loss", schedule._maybe_compute_loss)
    opt = OPTIMIZERS[cfg["optimizer"]]([p for p in stage_module.parameters() if p.requires_grad])
    targets: list[torch.Tensor] = []

    def one_step() -> None:
        counter.phase = "forward"
        if last and not targets:
            targets.append(torch.zeros((batch, seq), dtype=torch.int64))
        losses: list[torch.Tensor] = []
        if first and last:
            schedule.step(*inputs, target=targets[0], losses=losses)
        elif first:
            schedule.step(*inputs)
        elif last:
            schedule.step(target=targets[0], losses=losses)
        else:
            schedule.step()
        counter.phase = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)
        del losses

    return stage_module, opt, one_step


def _told_the_vote(schedule: Any) -> None:
    """The schedule's first step votes over point-to-point messages whether every stage was given
    its shapes; on the fake process group a receive leaves its buffer unwritten, so the vote would
    read garbage.  Every stage here is given its shapes (checked), so each is told the outcome."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise RuntimeError(f"pipeline stage {stage.stage_index} needs shape inference")
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warmup


def _rank_main(rank: int, cfg: dict[str, Any], outdir: str) -> None:
    """Entry point of a spawned rank: writes rank<N>.json (or raises, with the traceback)."""
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)
    if os.environ.get("DIST_ORACLE_DEBUG"):  # where each rank is, should the run hang
        import faulthandler
        faulthandler.dump_traceback_later(TIMEOUT_S / 3, exit=False, file=sys.stderr)
    if cfg["strategy"] == "pp":  # each stage runs for real; its sends and receives move no data
        # imported here, as a trainer imports it, not under the counter: the import makes a
        # 4-byte module constant (pipelining.microbatch.sum_reducer) that is no part of the step
        importlib.import_module("torch.distributed.pipelining")
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cfg["world_size"])
    else:
        _one_worker_gloo()
        _quiet_waits()
        # Rendezvous through a file in the run's own directory: TCPStore's server would listen on every
        # interface (*:port, it has no bind address); gloo's connections are bound to 127.0.0.1 above.
        store = dist.FileStore(str(Path(outdir, "store")), cfg["world_size"])
        dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg["world_size"],
                                timeout=datetime.timedelta(seconds=TIMEOUT_S / 2))
    try:
        result = _measure_rank(rank, cfg)
        dist.barrier()
    except BaseException:
        Path(outdir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# the parent


@contextlib.contextmanager
def _child_env(**values: str) -> Any:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _spawn_ranks(main: Callable[..., None], cfg: dict[str, Any], world_size: int, outdir: str) -> None:
    """Run ``main(rank, cfg, outdir)`` in ``world_size`` spawned processes and wait for them all.

    Raises RuntimeError when a rank fails (with the ranks' tracebacks) or the run takes longer
    than TIMEOUT_S; the ranks are then killed."""
    import torch.multiprocessing as mp

    with _child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"):
        context = mp.start_processes(main, args=(cfg, outdir), nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"distributed oracle timed out after {TIMEOUT_S:.0f} s: {cfg}")
    except Exception as error:
        errors = "\n".join(p.read_text() for p in sorted(Path(outdir).glob("rank*.err")))
        raise RuntimeError(f"distributed oracle failed: {cfg}\n{errors or error}") from error
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)


def measure_distributed(build: str, inputs: Sequence[str], *, strategy: str, world_size: int = 2,
                        optimizer: str = "adam", loss: str = "sum", iterations: int = 2,
                        units: Sequence[str] = (), reshard_after_forward: bool | None = None,
                        bucket_cap_mb: float = 25, gradient_as_bucket_view: bool = False,
                        param_dtype: str | None = None, reduce_dtype: str | None = None,
                        tp_plan: dict[str, str] | None = None, tp_degree: int = 1,
                        int_high: int = 100, microbatches: int = 0, schedule: str = "1f1b",
                        pp_stage: str = "tests.dist_oracles:gpt_stage",
                        pp_shapes: str = "tests.dist_oracles:gpt_stage_shapes",
                        shard: str | None = None) -> list[RankMeasured]:
    """Run the step for real in ``world_size`` spawned gloo ranks; one RankMeasured per rank, by rank.

    ``shard``: with "fsdp", ``package.module:fn`` called as ``fn(model, mesh)`` instead of the
    fully_shard calls of the module docstring (the code under test shards the model itself).

    Raises RuntimeError when a rank fails or the run takes longer than TIMEOUT_S (the ranks are
    then killed).  See the module docstring for the set-up, the strategies and the counting.
    """
    import json


    if strategy not in ("ddp", "fsdp", "zero1", "tp", "fsdp_tp", "pp", "hsdp"):
        raise ValueError(f"unknown strategy {strategy!r} (ddp, fsdp, zero1, tp, fsdp_tp, pp)")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r} ({', '.join(OPTIMIZERS)})")
    cfg = {"build": build, "inputs": list(inputs), "strategy": strategy, "world_size": world_size,
           "optimizer": optimizer, "loss": loss, "iterations": iterations, "units": list(units),
           "reshard_after_forward": reshard_after_forward, "bucket_cap_mb": bucket_cap_mb,
           "gradient_as_bucket_view": gradient_as_bucket_view, "param_dtype": param_dtype,
           "reduce_dtype": reduce_dtype, "tp_plan": tp_plan or {}, "tp_degree": tp_degree, "int_high": int_high,
           "microbatches": microbatches or world_size, "schedule": schedule, "pp_stage": pp_stage,
           "pp_shapes": pp_shapes, "shard": shard}
    with tempfile.TemporaryDirectory(prefix="dist_oracle_") as outdir:
        _spawn_ranks(_rank_main, cfg, world_size, outdir)
        results = []
        LAST_DETAILS.clear()
        for rank in range(world_size):
            data = json.loads(Path(outdir, f"rank{rank}.json").read_text())
            LAST_DETAILS.append(data)
            if data["cyclic_bytes"]:
                warnings.warn(f"rank {rank}: {data['cyclic_bytes']} bytes of storages were held in reference cycles "
                              "after the iterations; the peak then depends on when the cyclic GC runs (here: never "
                              f"during the iterations): {cfg}", stacklevel=2)
            results.append(RankMeasured(rank=data["rank"], peak_bytes=data["peak_bytes"],
                                        phase_peaks=data["phase_peaks"], start_bytes=data["start_bytes"]))
    return results


# ---------------------------------------------------------------------------------------------
# a whole program, as torchrun launches it


class _ProgramStop(BaseException):
    """Raised by the optimizer post-step hook after the last counted step."""


def _program_rank_main(rank: int, cfg: dict[str, Any], outdir: str) -> None:
    """A spawned rank of ``python SCRIPT ARGV`` under torchrun's environment: the program's own
    init_process_group (any backend) joins a gloo group through a FileStore in ``outdir``;
    storages are counted from the program's first line until its ``steps``-th (outermost) optimizer step
    returns.  Writes rank<N>.json."""
    import json
    import runpy

    import torch.distributed as dist
    torch.set_num_threads(1)
    world = cfg["world_size"]
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": HOST,
                       "MASTER_PORT": "29500"})
    _one_worker_gloo()
    _quiet_waits()
    start = dist.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        store = dist.FileStore(str(Path(outdir, "store")), world)
        start("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S / 2))

    dist.init_process_group = init_process_group
    counter = DistLiveStorages()
    counter.phase = "step 1"

    def after_step(done: int) -> None:
        if done >= cfg["steps"]:
            raise _ProgramStop
        counter.phase = f"step {done + 1}"

    handles = count_optimizer_steps(after_step)
    sys.argv = [cfg["script"], *cfg["argv"]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(cfg["script"])))
    try:
        with counter, contextlib.suppress(_ProgramStop):
            runpy.run_path(cfg["script"], run_name="__main__")
        dist.barrier()
    except BaseException:
        Path(outdir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        for handle in handles:
            handle.remove()
        if dist.is_initialized():
            dist.destroy_process_group()
    if counter.trace is not None:  # DIST_ORACLE_TRACE=1: every change of the live bytes, for debugging a count
        sys.stderr.write("\n".join(counter.trace) + "\n")
    Path(outdir, f"rank{rank}.json").write_text(json.dumps({"peak_bytes": counter.peak,
                                                            "phase_peaks": counter.phase_peaks}))


def measure_program_distributed(script: str, argv: Sequence[str] = (), *, world_size: int = 2,
                                steps: int = 2) -> list[dict[str, Any]]:
    """``torchrun --nproc-per-node world_size SCRIPT ARGV`` for real on the CPU (gloo), each rank
    counted as tests/oracles.py's measure_program counts; per rank, by rank: {"peak_bytes",
    "phase_peaks"} ("step N": the peak from the end of step N-1 to the end of step N)."""
    import json


    cfg = {"script": script, "argv": list(argv), "world_size": world_size, "steps": steps}
    with tempfile.TemporaryDirectory(prefix="dist_oracle_") as outdir:
        _spawn_ranks(_program_rank_main, cfg, world_size, outdir)
        return [json.loads(Path(outdir, f"rank{rank}.json").read_text()) for rank in range(world_size)]
