"""Per-rank ground truth for data-parallel training: run it for real with gloo on CPU, count storages.

Independent of graphmem's code (imports nothing from ``graphmem``).  ``world_size`` processes are
spawned on this machine; they meet over TCP on 127.0.0.1 only (a free port picked here) and each
runs the training step for real while a TorchDispatchMode counts the bytes of its live tensor
storages after every aten op: the method of ``tests/oracles.py`` (``LiveStorages``), extended for
distributed runs as described under "Counting" below.

Set-up, identical on every rank:
    torch.manual_seed(0); model = build(); model.train()
    torch.manual_seed(1000 + rank); inputs = tests.oracles.real_inputs(inputs, int_high)
    (each rank its own local batch, same shapes; values never change memory here)

Strategies, applied exactly like this (the predictor applies them identically):
    "ddp":   model = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb,
                                             gradient_as_bucket_view=gradient_as_bucket_view)
             opt = tests.oracles.OPTIMIZERS[optimizer](params of model.parameters() that require grad)
    "fsdp":  FSDP2.  mesh = init_device_mesh("cpu", (world_size,)); kwargs = dict(mesh=mesh,
             reshard_after_forward=reshard_after_forward) plus mp_policy=MixedPrecisionPolicy(
             param_dtype=..., reduce_dtype=...) only when param_dtype or reduce_dtype is given
             ("bfloat16", "float16", "float32"); fully_shard(m, **kwargs) on every submodule whose
             class name is in ``units`` (collected in model.modules() order before any is sharded;
             the root itself is not in that list), then fully_shard(model, **kwargs).
             opt = OPTIMIZERS[optimizer](model.parameters() that require grad)  (DTensor parameters)
    "zero1": DDP as above, then opt = torch.distributed.optim.ZeroRedundancyOptimizer(
             model.parameters(), optimizer_class=<torch.optim class>, **<its kwargs in
             tests.oracles.OPTIMIZERS>)   (see ZERO_OPTIMIZERS)

The step, per iteration, in a function whose locals die at its return (as tests/oracles.py):
    out = model(*inputs); loss = loss_fn(out); loss.backward(); opt.step();
    opt.zero_grad(set_to_none=True)        # out and loss are held until after the optimizer step
Phases: "forward" (model(*inputs), FSDP's all-gathers included), "loss", "backward" (DDP's
all-reduces and FSDP's reduce-scatters included), "optimizer" (step and zero_grad; ZeRO's
parameter broadcasts included).  The loss targets of "cross_entropy"/"nll" are made at the first
loss and stay alive, as in tests/oracles.py.

Counting (what this oracle adds to tests/oracles.py):
  * The counter is entered BEFORE the strategy is applied; the model's parameters, buffers and
    the inputs are registered first.  Every storage an aten op sees or returns on the main thread
    is tracked, so storages that the engines allocate in C++ are found by their own ops: C++ calls
    such as DDP's Reducer ``at::empty`` for its gradient buckets (at construction, and again when
    it rebuilds them at the start of the second forward) go through the dispatcher and reach the
    mode like any Python op (checked in tests/integration/test_dist_oracle.py: DDP's start equals
    parameters + buckets + inputs, buckets = parameter bytes).
  * ``start_bytes`` is taken after the strategy and the optimizer are built, just before the first
    iteration; ``peak_bytes`` and ``phase_peaks`` cover the iterations only.  What construction
    allocates and releases (FSDP's unsharded originals, DDP's broadcast temporaries) does not count.
  * A tensor subclass (DTensor, and any traceable wrapper subclass) counts by its inner tensors'
    storages (a DTensor by its local shard), never by its global shape.
  * Sizes are re-read from every tracked storage after every op (``storage.nbytes()``), so FSDP2's
    ``untyped_storage().resize_(0)`` / ``resize_(size)`` (``free_storage`` / ``alloc_storage``),
    which are not aten ops, are followed.
  * Every collective (any ``c10d`` op the mode sees, including those the DDP Reducer launches from
    C++ in backward) is waited on at once, and then drained: the default gloo group is built with
    ONE worker thread (``_threads = 1``, device bound to 127.0.0.1) and a barrier is run after the
    wait, so the worker has dropped its references to the collective's tensors before the program
    goes on.  Tensors are then released in program order, on the main thread, and the per-rank
    peaks are deterministic (the tests run a configuration twice).  This changes no allocation, only
    when gloo's thread lets go of what it used.
  * Not counted (outside tensor storages, or invisible to the mode): gloo's transport buffers, and
    temporaries that gloo allocates on its worker thread (e.g. the input-sized buffer of its
    reduce-scatter) or inside a collective's C++ implementation.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from tests.oracles import OPTIMIZERS, LiveStorages, _loss, real_inputs

TIMEOUT_S = 120.0
HOST = "127.0.0.1"
PHASES = ("forward", "loss", "backward", "optimizer")

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
        self.origin: dict[int, str] = {}  # storage key -> the op that first showed it ("registered")
        self.current = "registered"

    def add(self, t: Any) -> None:
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
        if getattr(func, "namespace", None) == "c10d":
            self._drain(leaves)
        self.ops += 1
        now = self.live_bytes()
        self.peak = max(self.peak, now)
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), now)
        return out

    def _drain(self, leaves: list[Any]) -> None:
        """Wait for the collective, then let gloo's single worker finish with it (a barrier runs after)."""
        import torch.distributed as dist

        waited = False
        for leaf in leaves:
            if isinstance(leaf, torch.ScriptObject):
                dist.distributed_c10d.Work.unbox(leaf).wait()
                waited = True
        if waited:
            self.collectives += 1
            dist.barrier()  # the mode is off inside its own handler: not counted, not drained again

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
    """Make the default gloo group use one worker thread and the loopback device only."""
    from torch.distributed import distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    if getattr(base, "_graphmem_oracle", False):
        return

    class OneWorkerGloo(base):  # type: ignore[misc, valid-type]
        _graphmem_oracle = True

        def __init__(self, store: Any, rank: int, size: int,
                     timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> None:
            options = base._Options()
            options._timeout = timeout
            options._threads = 1
            options._devices = [base.create_device(hostname=HOST)]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = OneWorkerGloo


def _apply_strategy(model: torch.nn.Module, cfg: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    strategy = cfg["strategy"]
    if strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_cap_mb"],
                                        gradient_as_bucket_view=cfg["gradient_as_bucket_view"])
        if strategy == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            cls, kwargs = ZERO_OPTIMIZERS[cfg["optimizer"]]
            return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)
    elif strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (cfg["world_size"],))
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": cfg["reshard_after_forward"]}
        if cfg["param_dtype"] is not None or cfg["reduce_dtype"] is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=MP_DTYPES[cfg["param_dtype"]] if cfg["param_dtype"] else None,
                reduce_dtype=MP_DTYPES[cfg["reduce_dtype"]] if cfg["reduce_dtype"] else None)
        units = [m for m in model.modules() if m is not model and type(m).__name__ in cfg["units"]]
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
    else:
        raise ValueError(f"unknown strategy {strategy!r} (ddp, fsdp, zero1)")
    return model, OPTIMIZERS[cfg["optimizer"]]([p for p in model.parameters() if p.requires_grad])


def _measure_rank(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
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
        model, opt = _apply_strategy(model, cfg)

        def one_step() -> None:
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

        start_bytes = counter.live_bytes()
        if os.environ.get("DIST_ORACLE_DEBUG"):
            print(f"rank {rank} live at start:", counter.live(), flush=True)
        counter.reset_peaks()
        for _ in range(cfg["iterations"]):
            one_step()
    return {"rank": rank, "peak_bytes": counter.peak, "phase_peaks": dict(counter.phase_peaks),
            "start_bytes": start_bytes, "collectives": counter.collectives}


def _rank_main(rank: int, cfg: dict[str, Any], port: int, outdir: str) -> None:
    """Entry point of a spawned rank: writes rank<N>.json (or raises, with the traceback)."""
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)
    _one_worker_gloo()
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank,
                            world_size=cfg["world_size"], timeout=datetime.timedelta(seconds=TIMEOUT_S / 2))
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


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


def measure_distributed(build: str, inputs: Sequence[str], *, strategy: str, world_size: int = 2,
                        optimizer: str = "adam", loss: str = "sum", iterations: int = 2,
                        units: Sequence[str] = (), reshard_after_forward: bool | None = None,
                        bucket_cap_mb: float = 25, gradient_as_bucket_view: bool = False,
                        param_dtype: str | None = None, reduce_dtype: str | None = None,
                        int_high: int = 100) -> list[RankMeasured]:
    """Run the step for real in ``world_size`` spawned gloo ranks; one RankMeasured per rank, by rank.

    Raises RuntimeError when a rank fails or the run takes longer than TIMEOUT_S (the ranks are
    then killed).  See the module docstring for the set-up, the strategies and the counting.
    """
    import json

    import torch.multiprocessing as mp

    if strategy not in ("ddp", "fsdp", "zero1"):
        raise ValueError(f"unknown strategy {strategy!r} (ddp, fsdp, zero1)")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r} ({', '.join(OPTIMIZERS)})")
    cfg = {"build": build, "inputs": list(inputs), "strategy": strategy, "world_size": world_size,
           "optimizer": optimizer, "loss": loss, "iterations": iterations, "units": list(units),
           "reshard_after_forward": reshard_after_forward, "bucket_cap_mb": bucket_cap_mb,
           "gradient_as_bucket_view": gradient_as_bucket_view, "param_dtype": param_dtype,
           "reduce_dtype": reduce_dtype, "int_high": int_high}
    with tempfile.TemporaryDirectory(prefix="dist_oracle_") as outdir:
        with _child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                        MASTER_ADDR=HOST):
            context = mp.start_processes(_rank_main, args=(cfg, _free_port(), outdir), nprocs=world_size,
                                         join=False, start_method="spawn")
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
        results = []
        for rank in range(world_size):
            data = json.loads(Path(outdir, f"rank{rank}.json").read_text())
            results.append(RankMeasured(rank=data["rank"], peak_bytes=data["peak_bytes"],
                                        phase_peaks=data["phase_peaks"], start_bytes=data["start_bytes"]))
    return results
