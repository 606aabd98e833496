"""The --parallel configurations checked against real multi-process runs (tests/dist_oracles.py):
used by tests/integration/test_parallel_oracle.py and benchmarks/accuracy_parallel.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MLP = ("tests.models:MLP", ("8x1000",), "sum", ("Linear",))
UNEVEN = ("tests.dist_oracles:uneven_mlp", ("8x999",), "sum", ("Linear",))
GPT = ("tests.dist_oracles:small_gpt", ("2x16:int64",), "cross_entropy", ("Block",))
LLAMA = ("tests.dist_oracles:small_llama", ("2x16:int64",), "sum", ("LlamaDecoderLayer",))
# tensor parallel: the MLP's first Linear column-wise, its last row-wise; Llama: its own plan
MLP_TP_PLAN = {"layers.0": "colwise", "layers.2": "rowwise"}


@dataclass(frozen=True)
class ParallelCase:
    """One configuration, as the oracle's keywords; ``keywords()`` gives graphmem's."""

    model: tuple[str, tuple[str, ...], str, tuple[str, ...]]
    strategy: str
    optimizer: str
    options: dict[str, Any] = field(default_factory=dict)
    world_size: int = 2
    tp: int = 2  # fsdp_tp: the tensor-parallel degree

    @property
    def name(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.model[0].rpartition(':')[2]}-{self.strategy}{self.world_size}-{self.optimizer}" + \
            (f"-{opts}" if opts else "")

    def oracle_keywords(self) -> dict[str, Any]:
        build, inputs, loss, units = self.model
        extra: dict[str, Any] = {"units": units} if self.strategy.startswith("fsdp") or self.strategy == "hsdp" \
            else {}
        if "tp" in self.strategy:
            extra.update(tp_plan=self.plan, tp_degree=self.tp)
        if self.strategy == "hsdp":  # self.tp is the shard degree here
            extra.update(tp_degree=self.tp)
        return dict(build=build, inputs=inputs, strategy=self.strategy, world_size=self.world_size,
                    optimizer=self.optimizer, loss=loss, **extra, **self.options)

    @property
    def plan(self) -> dict[str, str] | None:
        return MLP_TP_PLAN if self.model is MLP else None

    @property
    def parallel(self) -> str:
        if self.strategy == "fsdp_tp":
            return f"fsdp={self.world_size // self.tp},tp={self.tp}"
        if self.strategy == "hsdp":  # replicate x shard, self.tp the shard degree
            return f"ddp={self.world_size // self.tp},fsdp={self.tp}"
        return f"{self.strategy}={self.world_size}"

    def graphmem_keywords(self) -> dict[str, Any]:
        build, inputs, loss, units = self.model
        o = self.options
        return dict(model=build, inputs=list(inputs), mode="train", optimizer=self.optimizer, loss=loss,
                    parallel=self.parallel, tp_plan=self.plan if "tp" in self.strategy else None,
                    fsdp_units=units if self.strategy.startswith("fsdp") or self.strategy == "hsdp" else (),
                    reshard_after_forward=o.get("reshard_after_forward"),
                    mp_param_dtype=o.get("param_dtype"), mp_reduce_dtype=o.get("reduce_dtype"),
                    ddp_bucket_mb=o.get("bucket_cap_mb", 25), ddp_bucket_view=o.get("gradient_as_bucket_view", False))


CASES: tuple[ParallelCase, ...] = (
    *(ParallelCase(model, "ddp", opt) for model in (MLP, GPT) for opt in ("sgd", "adam")),
    ParallelCase(MLP, "ddp", "adam", {"bucket_cap_mb": 1}),
    *(ParallelCase(model, "ddp", "adam", {"gradient_as_bucket_view": True}) for model in (MLP, GPT)),
    *(ParallelCase(model, "fsdp", opt) for model in (MLP, GPT) for opt in ("sgd", "adam")),
    *(ParallelCase(model, "fsdp", "adam", {"reshard_after_forward": flag}) for model in (MLP, GPT)
      for flag in (True, False)),
    *(ParallelCase(model, "fsdp", "adam", {"param_dtype": "bfloat16", "reduce_dtype": "float32"})
      for model in (MLP, GPT)),
    ParallelCase(UNEVEN, "fsdp", "adam"),
    ParallelCase(UNEVEN, "fsdp", "adam", world_size=4),
    *(ParallelCase(model, "zero1", "adam") for model in (MLP, GPT)),
    ParallelCase(MLP, "zero1", "adam", world_size=4),
    *(ParallelCase(MLP, "tp", opt) for opt in ("sgd", "adam")),
    ParallelCase(MLP, "fsdp_tp", "adam", world_size=4),
    *(ParallelCase(model, "hsdp", "adam", world_size=4) for model in (MLP, GPT)),
    ParallelCase(LLAMA, "tp", "adamw"),
    ParallelCase(LLAMA, "fsdp", "adamw"),
)
