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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphmem.cuda.nccl import DEFAULT_NCCL_BUFFER_MB
from graphmem.errors import UserInputError
from graphmem.job.choices import MODEL_DTYPES
from graphmem.job.grammar import dtype_name, format_blocks, format_units, parse_blocks
from graphmem.job.option import flag, option, shown
from graphmem.job.step_config import blocks_of, names_of

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


def _parallel_json(degrees: tuple[tuple[str, int], ...] | None, facts: Mapping[str, Any]) -> dict[str, Any] | None:
    """The parallelism as the JSON ``setup`` shows it, with the rank the report shows."""
    if degrees is None:
        return None
    keep = facts["section"]["keep_units"]
    return {"spec": _text(degrees), "world_size": math.prod(d for _, d in degrees),
            "rank_shown": facts.get("rank_shown"), "ranks_alike": facts.get("ranks_alike"),
            **({"fsdp_keep_units": list(keep)} if keep else {})}


def _parallel_row(degrees: tuple[tuple[str, int], ...] | None, facts: Mapping[str, Any]) -> str:
    if degrees is None:
        return ""
    alike = facts.get("ranks_alike") or ()
    also = f" (ranks {_ranks_text(alike)} alike)" if len(alike) > 1 else ""
    rank = f"; the numbers are rank {facts['rank_shown']}'s, the highest peak{also}" \
        if facts.get("rank_shown") is not None else ""
    return f"{_text(degrees)} over {math.prod(d for _, d in degrees)} GPUs{rank}"


def _kept_row(units: tuple[int, ...] | None, facts: Mapping[str, Any]) -> str:
    if not units:
        return ""
    return f"{format_units(units)} {'keeps its' if len(units) == 1 else 'keep their'} parameters after forward"


def _ranks_text(ranks: Sequence[int]) -> str:
    # (0, 1, 2, 3) -> "0-3"; (0, 2) -> "0, 2"
    ordered = sorted(ranks)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ", ".join(map(str, ordered))


def _text(degrees: tuple[tuple[str, int], ...]) -> str:
    return ",".join(f"{name}={degree}" for name, degree in degrees)


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

    degrees: tuple[tuple[str, int], ...] = field(metadata=option(
        "--parallel", metavar="NAME=N[,NAME=N]", from_field=lambda degrees: ",".join(f"{n}={d}" for n, d in degrees),
        help="Training spread over GPUs, applied by PyTorch's own engines; memory per GPU: ddp=8 "
             "(DistributedDataParallel), fsdp=8 (FSDP2 fully_shard), ddp=2,fsdp=4 (HSDP), zero1=8 (DDP with "
             "ZeroRedundancyOptimizer), tp=8 (tensor parallel; see --tp-plan), fsdp=4,tp=2 (FSDP2 + tensor "
             "parallel, 2-D), pp=4 (pipeline parallel; see --schedule).")
        | shown(key="parallel", at_json=60, json=_parallel_json, label="parallel", at_row=80, row=_parallel_row))
    parallelize: str | Callable[..., Any] | None = field(default=None, metadata=option(
        "--parallelize", metavar="pkg.module:fn",
        help="With --parallel: your own fn(model, mesh) that applies your parallelism (the one your trainer calls), "
             "run unchanged on the mesh --parallel describes."))
    tp_plan: str | Mapping[str, Any] | None = field(default=None, metadata=option(
        "--tp-plan", metavar="pkg.module:PLAN",
        help="With tp: a dict of module name (* matches one name) -> colwise | rowwise | colwise_rep | rowwise_rep "
             "| sequence_parallel (default: a transformers model's own base_model_tp_plan)."))
    microbatches: int | None = field(default=None, metadata=option(
        "--microbatches", kind="int", minimum=1, metavar="M",
        help="With --parallel pp=N: microbatches per step (default N; the batch must divide evenly)."))
    schedule: str = field(default="1f1b", metadata=option(
        "--schedule", choices=tuple(PP_SCHEDULES), default="1f1b", show_default=True,
        help="With --parallel pp=N: the pipeline schedule (ScheduleGPipe or Schedule1F1B)."))
    units: tuple[str, ...] = field(default=(), metadata=option(
        "--fsdp-units", default="", metavar="CLASS[,CLASS]", to_field=names_of,
        help="With fsdp: the classes of the modules sharded as units (default: the model's repeated blocks)."))
    reshard_after_forward: bool | None = field(default=None, metadata=option(
        "--reshard-after-forward", choices=("default", "true", "false"), default="default", show_default=True,
        to_field=lambda value: {"default": None, "true": True, "false": False}.get(value, value),
        to_text=lambda value: {None: "default", True: "true", False: "false"}[value],
        help="With fsdp: fully_shard's reshard_after_forward (default: every unit but the root)."))
    keep_units: tuple[int, ...] = field(default=(), metadata=option(
        "--fsdp-keep-units", parse=parse_blocks, done=tuple, metavar="I[-J][,...]", default="", to_field=blocks_of,
        to_text=format_blocks,
        help="With fsdp: these units (0-based, in the model's order; the root is none of them) keep their parameters "
             "after forward (reshard_after_forward=False), the others as --reshard-after-forward says: what "
             "graphmem plan --policy chooses unit by unit.")
        | shown(label="FSDP2", at_row=90, row=_kept_row))
    param_dtype: str | None = field(default=None, metadata=option(
        "--mp-param-dtype", choices=MODEL_DTYPES,
        help="With fsdp: MixedPrecisionPolicy param_dtype (the all-gathered parameters' dtype)."))
    reduce_dtype: str | None = field(default=None, metadata=option(
        "--mp-reduce-dtype", choices=MODEL_DTYPES,
        help="With fsdp: MixedPrecisionPolicy reduce_dtype (the gradients' reduce-scatter dtype)."))
    bucket_mb: float = field(default=25.0, metadata=option(
        "--ddp-bucket-mb", kind="float", minimum=0, open_minimum=True, default=25.0, show_default=True,
        help="With ddp / zero1: DDP's bucket_cap_mb."))
    bucket_view: bool = field(default=False, metadata=option(
        "--ddp-bucket-view/--no-ddp-bucket-view", keyword="ddp_bucket_view", kind="flag", default=False,
        show_default=True, help="With ddp / zero1: DDP's gradient_as_bucket_view."))
    nccl_buffer_mb: float = field(default=DEFAULT_NCCL_BUFFER_MB, metadata=option(
        "--nccl-buffer-mb", kind="float", minimum=0, default=DEFAULT_NCCL_BUFFER_MB, show_default=True, metavar="MIB",
        help="With --parallel on a GPU: MiB of NCCL's own buffers per communicator, outside PyTorch's allocator "
             "(default: 32 channels x NCCL's default buffers of 4 MiB, 512 KiB and 4.7 MiB; docs/parallel.md)."))

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
                dtype_name(dtype)

    @classmethod
    def fold(cls, values: Mapping[str, Any]) -> ParallelSpec | None:
        """The spec ``--parallel`` and the engines' settings describe (None: one device)."""
        from graphmem.job.option import field_values

        given = values.get("parallel")
        if isinstance(given, ParallelSpec) or given is None:
            if given is None and any(values.get(key) is not None for key in ("parallelize", "tp_plan", "microbatches")):
                raise UserInputError(f"{flag(cls, 'parallelize')}, {flag(cls, 'tp_plan')} and "
                                     f"{flag(cls, 'microbatches')} need {flag(cls, 'degrees')} to describe the mesh, "
                                     f"e.g. {flag(cls, 'degrees')} fsdp=8, tp=2 or pp=4")
            return given
        return cls(**{**field_values(cls, values), "degrees": parse_parallel(given).degrees})

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
