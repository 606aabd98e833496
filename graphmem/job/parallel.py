"""``--parallel SPEC``: how the step is spread over GPUs (data parallel, sharded data parallel).

``SPEC`` is a comma list of ``NAME=DEGREE`` whose product is the world size:

- ``ddp=N``: DistributedDataParallel (gradient buckets of ``bucket_mb``, optional bucket views);
- ``fsdp=N``: FSDP2 ``fully_shard`` on each unit (the repeated blocks by default), then the root;
- ``ddp=R,fsdp=S``: HSDP, FSDP2 on a 2-D mesh (replicate R x shard S);
- ``zero1=N``: DistributedDataParallel with ZeroRedundancyOptimizer;
- ``tp=N``: tensor parallel, ``parallelize_module`` with a plan (the transformers model's own
  ``base_model_tp_plan``, or one given); ``fsdp=D,tp=T``: FSDP2 over D on top (2-D);
- ``pp=N``: pipeline parallel, torch.distributed.pipelining (``PipelineStage`` per rank, the
  ``gpipe`` or ``1f1b`` schedule over ``microbatches`` microbatches); the model's repeated
  blocks are cut into N contiguous stages.

Pure parsing and validation: nothing here imports torch.distributed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from graphmem.cuda.nccl import DEFAULT_NCCL_BUFFER_MB
from graphmem.errors import UserInputError
from graphmem.job.spec import parse_dtype

__all__ = ["PARALLEL_NAMES", "PP_SCHEDULES", "TP_STYLES", "ParallelSpec", "parse_parallel"]

# strategy name -> what it is, for messages and --help
PARALLEL_NAMES = {
    "ddp": "DistributedDataParallel (replicated parameters, gradient buckets)",
    "fsdp": "FSDP2 fully_shard (parameters, gradients and optimizer state sharded)",
    "zero1": "DistributedDataParallel with ZeroRedundancyOptimizer (optimizer state sharded)",
    "tp": "tensor parallel (parallelize_module with the model's or your plan)",
    "pp": "pipeline parallel (torch.distributed.pipelining, the repeated blocks cut into stages)",
}
# pipeline schedules: name -> torch.distributed.pipelining class
PP_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
# the styles a plan may name, as transformers names them
TP_STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "sequence_parallel")
# planned, named so that the message says so instead of "unknown"
_NOT_YET = {"cp": "context parallel"}
_COMBINATIONS = ({"ddp"}, {"fsdp"}, {"zero1"}, {"ddp", "fsdp"}, {"tp"}, {"fsdp", "tp"}, {"pp"})


@dataclass(frozen=True, slots=True)
class ParallelSpec:
    """How the step is parallelised; checked when built.

    Attributes:
        degrees: (strategy, degree) pairs in the order given, e.g. (("ddp", 2), ("fsdp", 4)).
        bucket_mb: DDP's ``bucket_cap_mb``.
        bucket_view: DDP's ``gradient_as_bucket_view``.
        reshard_after_forward: FSDP2's ``reshard_after_forward`` (None: its default, every
            unit but the root reshards).
        keep_units: with fsdp, the units (0-based, in ``model.modules()`` order, the root not
            among them) whose ``reshard_after_forward`` is False: they keep their unsharded
            parameters from forward to backward, the others as ``reshard_after_forward`` says.
        param_dtype / reduce_dtype: FSDP2's MixedPrecisionPolicy (None: no policy).
        units: the classes of the modules FSDP2 shards as units; empty: the model's
            repeated blocks.
        tp_plan: with tp: module name (``*`` matches any one name) -> style (one of
            TP_STYLES, or a torch ParallelStyle), or ``pkg.module:PLAN`` naming such a dict;
            None: the transformers model's own ``base_model_tp_plan``.
        parallelize: the user's own function ``fn(model, mesh)`` (or its ``pkg.module:fn``)
            that applies their parallelism instead of graphmem's; ``mesh`` has one dimension
            per strategy, named as in ``degrees``.  It may return the module to call (a DDP
            wrapper); otherwise the model it changed is called.
        microbatches: with pp: the microbatches one step's batch is split into (None: the
            pipeline degree); the batch must divide evenly.
        schedule: with pp: ``gpipe`` (ScheduleGPipe) or ``1f1b`` (Schedule1F1B).
        nccl_buffer_mb: on the CUDA target, MiB of NCCL's own buffers per communicator
            (outside PyTorch's caching allocator; default and derivation in graphmem.cuda.nccl).
    """

    degrees: tuple[tuple[str, int], ...]
    bucket_mb: float = 25.0
    bucket_view: bool = False
    reshard_after_forward: bool | None = None
    keep_units: tuple[int, ...] = ()
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    units: tuple[str, ...] = ()
    tp_plan: str | Mapping[str, Any] | None = None
    parallelize: str | Callable[..., Any] | None = None
    microbatches: int | None = None
    schedule: str = "1f1b"
    nccl_buffer_mb: float = DEFAULT_NCCL_BUFFER_MB

    def __post_init__(self) -> None:
        names = [name for name, _ in self.degrees]
        for name, degree in self.degrees:
            if name in _NOT_YET:
                raise UserInputError(f"--parallel {name}: {_NOT_YET[name]} is not supported yet; supported: "
                                     f"{', '.join(PARALLEL_NAMES)}")
            if name not in PARALLEL_NAMES:
                raise UserInputError(f"--parallel: unknown strategy {name!r}; expected {', '.join(PARALLEL_NAMES)}")
            if degree < 1:
                raise UserInputError(f"--parallel {name}={degree}: the degree must be a positive integer")
        if len(set(names)) != len(names) or set(names) not in _COMBINATIONS:
            raise UserInputError(f"--parallel {self.text}: the combinations are ddp, fsdp, zero1, tp or pp alone, "
                                 "ddp,fsdp (HSDP) and fsdp,tp (2-D)")
        if self.bucket_mb <= 0:
            raise UserInputError(f"--ddp-bucket-mb must be positive, got {self.bucket_mb}")
        if not self.nccl_buffer_mb >= 0:  # (also refuses NaN)
            raise UserInputError(f"--nccl-buffer-mb must be 0 or more, got {self.nccl_buffer_mb}")
        if isinstance(self.tp_plan, Mapping):
            bad = {k: v for k, v in self.tp_plan.items() if isinstance(v, str) and v not in TP_STYLES}
            if bad:
                raise UserInputError(f"tensor-parallel plan: unknown styles {bad}; expected {', '.join(TP_STYLES)} "
                                     "or a torch.distributed.tensor.parallel.ParallelStyle")
        if self.tp_plan is not None and "tp" not in names:
            raise UserInputError("a tensor-parallel plan needs tp in --parallel, e.g. --parallel tp=2")
        if self.schedule not in PP_SCHEDULES:
            raise UserInputError(f"--schedule {self.schedule!r}: expected one of {', '.join(PP_SCHEDULES)}")
        if self.microbatches is not None and self.microbatches < 1:
            raise UserInputError(f"--microbatches must be a positive integer, got {self.microbatches}")
        if self.microbatches is not None and "pp" not in names:
            raise UserInputError("--microbatches needs pp in --parallel, e.g. --parallel pp=2")
        if "pp" in names and self.parallelize is not None:
            raise UserInputError("--parallelize is not supported with pp: graphmem cuts the stages itself")
        for dtype in (self.param_dtype, self.reduce_dtype):
            if dtype is not None:
                parse_dtype(dtype)

    @property
    def world_size(self) -> int:
        return math.prod(degree for _, degree in self.degrees)

    @property
    def text(self) -> str:
        return ",".join(f"{name}={degree}" for name, degree in self.degrees)

    def degree(self, name: str) -> int:
        """The degree of one strategy (1 when absent)."""
        return dict(self.degrees).get(name, 1)

    @property
    def pipelined(self) -> bool:
        """Pipeline parallel: each rank holds one stage."""
        return "pp" in dict(self.degrees)

    @property
    def n_microbatches(self) -> int:
        """The microbatches of one pipeline step (``microbatches``, else the pipeline degree)."""
        return self.microbatches if self.microbatches is not None else self.degree("pp")

    @property
    def communicators(self) -> int:
        """NCCL communicators one rank holds: one per process group its collectives use (each
        strategy of degree > 1: a 2-D mesh has one group per dimension).  A pipeline stage sends
        and receives over a two-rank communicator per neighbouring stage (ProcessGroupNCCL keys a
        lone send or receive by the pair of ranks; the schedules issue them alone when a batch is
        all sends or all receives, torch/distributed/pipelining/schedules.py ``_batch_p2p``) and
        over its group's own for mixed batches: 2 with pp=2, 3 from pp=3 on (a first or last
        stage has one neighbour: one too many there)."""
        count = 0
        for name, degree in self.degrees:
            if degree > 1:
                count += min(degree - 1, 2) + 1 if name == "pp" else 1
        return count

    @property
    def shards(self) -> bool:
        """FSDP2 shards the parameters."""
        return "fsdp" in dict(self.degrees)


def parse_parallel(text: str) -> ParallelSpec:
    """``"fsdp=8"`` or ``"ddp=2,fsdp=4"`` -> ParallelSpec (default engine settings)."""
    degrees = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*([A-Za-z0-9_]+)\s*=\s*(\d+)\s*", part)
        if match is None:
            raise UserInputError(f"malformed --parallel {text!r}; expected NAME=DEGREE[,NAME=DEGREE], "
                                 "e.g. fsdp=8 or ddp=2,fsdp=4")
        degrees.append((match[1].lower(), int(match[2])))
    return ParallelSpec(tuple(degrees))
