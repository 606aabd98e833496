"""The what-if rows of ``graphmem plan``, one builder per remedy.

Input: a ``PlanContext`` (the job, its budget, the analysed baseline, the model's structure).
Output: ``PlanRow`` values.  Rows that change execution are analysed with analyze() (the
real PyTorch code on fake tensors); the others apply a formula from plan_formulas.py to the
baseline's own analysed bytes, and say "formula".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from graphmem.errors import GraphmemError
from graphmem.job.job import Job
from graphmem.job.load import ModelSource
from graphmem.job.parallel import parse_parallel
from graphmem.job.spec import InputSpec, parse_dtype, parse_input_spec, substitute
from graphmem.memory.results import ModeReport
from graphmem.preflight.budget import Budget
from graphmem.preflight.check import Prediction, predict
from graphmem.preflight.formulas import (
    Scaling,
    csr_break_even_density,
    csr_bytes,
    int4_weight_bytes,
    int8_weight_bytes,
    offload_scaling,
    scaled_peak,
    shrink_scaling,
)
from graphmem.preflight.model_facts import ModelFacts, pruned_factory

__all__ = [
    "Analysed",
    "PlanContext",
    "PlanRow",
    "accumulation_rows",
    "amp_rows",
    "analysed_row",
    "batch_templates",
    "checkpoint_rows",
    "formula_row",
    "half_precision_rows",
    "job_with",
    "optimizer_rows",
    "prune_rows",
    "quantization_rows",
    "scaled_row",
    "sharding_rows",
    "sparse_row",
]

BATCH = "B"


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One remedy (or combination) and its prediction.

    Attributes:
        name: what to do, in words.
        changes: the same as data: batch, optimizer, amp, checkpoint, grad_accum, dtype,
            prune_amount / prune_remove, parallel ("zero1=8", "fsdp=8", "fsdp=8:keep": FSDP2
            without resharding after forward) (analysed); offload, quantize, sparse, shrink
            (formulas).
        peak_bytes: the predicted peak (the budget's metric: allocated on cuda).
        saving_bytes: baseline peak minus this peak (negative: it adds memory).
        extra_compute: FLOPs per sample over the baseline's, minus 1 (0.33: a third more);
            None when unknown.
        source: "analysis", "formula" or "analysis + formula".
        effort: 0 a flag or a setting, 1 changes the weights, 2 needs more hardware.
        tier: how much it changes what is trained (see ``math_tier``): 0 the same math,
            1 other numerics (mixed precision), 2 different training (another optimizer, a
            smaller global batch, pruned or quantized weights).
    """

    name: str
    changes: Mapping[str, Any]
    peak_bytes: int
    saving_bytes: int
    extra_compute: float | None
    fits: bool
    source: str
    effort: int = 0
    note: str = ""

    @property
    def tier(self) -> int:
        return math_tier(self.changes)


# changes that train something else: another optimizer, other weights
_DIFFERENT_TRAINING = frozenset({"optimizer", "prune_amount", "prune_remove", "quantize", "sparse", "shrink",
                                 "dtype"})


def math_tier(changes: Mapping[str, Any]) -> int:
    """0: the same math (checkpointing, optimizer implementation, sharding, offload,
    accumulation keeping the samples per step); 1: other numerics (autocast); 2: different
    training (another optimizer, fewer samples per step, pruned, quantized or converted weights)."""
    if _DIFFERENT_TRAINING & set(changes) or ("batch" in changes and "grad_accum" not in changes):
        return 2
    return 1 if "amp" in changes else 0


@dataclass(frozen=True, slots=True)
class PlanContext:
    """Everything the row builders share."""

    job: Job                       # the baseline; job.model is resolved (no strings)
    source: ModelSource
    budget: Budget
    base: Prediction               # the baseline, analysed in job.mode
    batch: int | None              # the baseline's batch (first input's first dimension)
    templates: tuple[str, ...]     # the inputs with the batch dimension written B
    facts: ModelFacts
    world_size: int = 8
    prune_amount: float = 0.5
    group_size: int = 128

    @property
    def samples(self) -> int:
        """Samples in the baseline's recorded FLOPs (see recorded_samples)."""
        return recorded_samples(self.job.mode, self.batch or 1, self.job.step.grad_accum)


@dataclass(frozen=True, slots=True)
class Analysed:
    """A row and the analysis behind it (None for formula rows)."""

    row: PlanRow
    prediction: Prediction | None


def recorded_samples(mode: str, batch: int, grad_accum: int) -> int:
    """Samples per recorded iteration: the trace records min(grad_accum, 2) micro-steps per
    optimizer step (the later ones repeat the second exactly; graphmem/trace/tracer.py)."""
    return batch * (min(grad_accum, 2) if mode == "train" else 1)


def batch_templates(inputs: Sequence[str]) -> tuple[int | None, tuple[str, ...]]:
    """The batch (first input's first dimension) and the inputs with every first dimension
    equal to it written ``B``."""
    specs = [parse_input_spec(t) for t in inputs]
    if not specs or not specs[0].shape:
        return None, tuple(inputs)
    batch = specs[0].shape[0]
    return batch, tuple(_with_first_dim(s, BATCH) if s.shape and s.shape[0] == batch else str(s)
                        for s in specs)


def _with_first_dim(spec: InputSpec, first: str) -> str:
    dims = "x".join([first, *(str(d) for d in spec.shape[1:])])
    return f"{spec.name + '=' if spec.name else ''}{dims}:{str(spec.dtype).removeprefix('torch.')}"


def _float_inputs_to(text: str, dtype_name: str) -> str:
    spec = parse_input_spec(text)
    return str(replace(spec, dtype=parse_dtype(dtype_name))) if spec.dtype.is_floating_point else text


def job_with(ctx: PlanContext, changes: Mapping[str, Any]) -> Job:
    """The baseline job with ``changes`` (the analysed kinds) applied."""
    inputs = [substitute(t, BATCH, changes.get("batch", ctx.batch or 1)) for t in ctx.templates]
    updates: dict[str, Any] = {key: changes[key] for key in ("optimizer", "amp", "grad_accum", "checkpoint",
                                                             "checkpoint_every", "checkpoint_save", "optimizer_impl")
                               if key in changes}
    if "dtype" in changes:
        inputs = [_float_inputs_to(t, changes["dtype"]) for t in inputs]
        updates["dtype"] = parse_dtype(changes["dtype"])
    if "parallel" in changes:
        text, _, keep = changes["parallel"].partition(":")
        updates["parallel"] = replace(parse_parallel(text), reshard_after_forward=False if keep else None)
    if "prune_amount" in changes:
        updates.update(model=pruned_factory(ctx.source, ctx.job.model_kwargs, changes["prune_amount"],
                                            changes.get("prune_remove", False), ctx.job.hf_config,
                                            ctx.job.device),
                       model_kwargs={}, hf_config=None)
    return ctx.job.updated(inputs=inputs, **updates)


def _mode(prediction: Prediction) -> ModeReport:
    return prediction.mode_report


def analysed_row(ctx: PlanContext, name: str, changes: Mapping[str, Any], *, effort: int = 0,
                 note: str = "", source: str = "analysis") -> Analysed | str:
    """Analyse the job with ``changes``; a row, or why it could not be analysed."""
    try:
        prediction = predict(job_with(ctx, changes))
    except GraphmemError as exc:
        return f"{name}: not analysed ({exc})"
    samples = recorded_samples(ctx.job.mode, int(changes.get("batch", ctx.batch or 1)),
                               int(changes.get("grad_accum", ctx.job.step.grad_accum)))
    base = _mode(ctx.base)
    extra = (_mode(prediction).flops * ctx.samples) / (base.flops * samples) - 1 if base.flops else None
    row = PlanRow(name=name, changes=dict(changes), peak_bytes=prediction.peak_bytes,
                  saving_bytes=ctx.base.peak_bytes - prediction.peak_bytes, extra_compute=extra,
                  fits=ctx.budget.fits(prediction.peak_bytes), source=source, effort=effort, note=note)
    return Analysed(row, prediction)


def formula_row(ctx: PlanContext, name: str, changes: Mapping[str, Any], peak: int, *, effort: int,
                note: str, source: str = "formula") -> Analysed:
    """A row whose peak comes from a formula."""
    row = PlanRow(name=name, changes=dict(changes), peak_bytes=peak, saving_bytes=ctx.base.peak_bytes - peak,
                  extra_compute=0.0, fits=ctx.budget.fits(peak), source=source, effort=effort, note=note)
    return Analysed(row, None)


def scaled_row(ctx: PlanContext, on: Analysed | None, name: str, changes: Mapping[str, Any], scaling: Scaling,
               *, effort: int, note: str) -> Analysed:
    """A formula row that rescales the categories of an analysed run (the baseline by default)."""
    prediction = on.prediction if on is not None and on.prediction is not None else ctx.base
    mode = _mode(prediction)
    overhead = prediction.peak_bytes - mode.peak_bytes  # CUDA: allocator rounding and workspaces
    peak = scaled_peak(mode.lifetimes, [op.phase for op in mode.trace.ops],
                       [op.scratch_bytes for op in mode.trace.ops], scaling) + overhead
    merged = {**(on.row.changes if on is not None else {}), **changes}
    label = f"{on.row.name} + {name}" if on is not None else name
    source = "analysis + formula" if on is not None else "formula"
    extra = on.row.extra_compute if on is not None else 0.0
    result = formula_row(ctx, label, merged, peak, effort=max(effort, on.row.effort if on else 0),
                         note=note, source=source)
    return Analysed(replace(result.row, extra_compute=extra), None)


def checkpoint_rows(ctx: PlanContext) -> list[Analysed | str]:
    """Activation checkpointing of each repeated block class, and for the first: of every
    second block, and selectively (matmul outputs kept) (training)."""
    if ctx.job.step.checkpoint:
        return []
    rows = [analysed_row(ctx, f"checkpoint every {cls}", {"checkpoint": [cls]},
                         note="non-reentrant torch.utils.checkpoint; backward re-runs the block's forward")
            for cls in ctx.facts.block_classes[:3]]
    for cls in ctx.facts.block_classes[:1]:
        rows += [analysed_row(ctx, f"checkpoint every 2nd {cls}", {"checkpoint": [cls], "checkpoint_every": 2},
                              note="half the blocks re-run their forward"),
                 analysed_row(ctx, f"checkpoint every {cls}, keeping matmul outputs",
                              {"checkpoint": [cls], "checkpoint_save": ["matmuls"]},
                              note="selective checkpointing: only the cheap ops are recomputed")]
    return rows


def implementation_rows(ctx: PlanContext) -> list[Analysed | str]:
    """The same optimizer with its fused or foreach implementation (training)."""
    current = ctx.job.step.optimizer_impl
    return [analysed_row(ctx, f"{impl} {ctx.job.step.optimizer} implementation", {"optimizer_impl": impl},
                         note="same update, other kernels")
            for impl in ("fused", "foreach") if impl != current and ctx.job.step.optimizer != "none"]


def amp_rows(ctx: PlanContext) -> list[Analysed | str]:
    """bf16 / fp16 autocast (fp16 with a GradScaler when training)."""
    if ctx.job.step.amp:
        return []
    scaler = " + GradScaler" if ctx.job.mode == "train" else ""
    return [analysed_row(ctx, "bf16 autocast", {"amp": "bf16"}, note="parameters stay fp32"),
            analysed_row(ctx, f"fp16 autocast{scaler}", {"amp": "fp16"}, note="parameters stay fp32")]


_OPTIMIZER_ROWS = (("sgd", "SGD (no optimizer state)", ""),
                   ("sgd-momentum", "SGD with momentum (1 state)", ""),
                   ("adamw", "AdamW (2 states)", ""),
                   ("adamw8bit", "8-bit AdamW (bitsandbytes)",
                    "state by formula: 1 B per element per state + a float32 absmax per 256"))


def optimizer_rows(ctx: PlanContext) -> list[Analysed | str]:
    """Other optimizers: SGD, SGD with momentum, AdamW, 8-bit AdamW (training)."""
    current = ctx.job.step.optimizer
    same = {"adam": "adamw", "adamw": "adamw"}.get(current, current)
    return [analysed_row(ctx, label, {"optimizer": name}, note=note,
                         source="analysis + formula" if note else "analysis")
            for name, label, note in _OPTIMIZER_ROWS if name != same]


def accumulation_rows(ctx: PlanContext) -> list[Analysed | str]:
    """The same samples per step in 2 or 4 micro-batches (training)."""
    base = ctx.job.step.grad_accum
    batch = ctx.batch or 1
    return [analysed_row(ctx, f"batch {batch // k} x {k * base} accumulation steps",
                         {"batch": batch // k, "grad_accum": k * base},
                         note=f"same {batch * base} samples per optimizer step")
            for k in (2, 4) if batch % k == 0]


def half_precision_rows(ctx: PlanContext) -> list[Analysed | str]:
    """Weights (and float inputs) in bf16 or fp16 (inference)."""
    if ctx.job.dtype is not None:
        return []
    return [analysed_row(ctx, f"{name} weights (model.to({name}))", {"dtype": name}, effort=1,
                         note="float inputs converted too")
            for name in ("bfloat16", "float16")]


def prune_rows(ctx: PlanContext) -> list[Analysed | str]:
    """torch.nn.utils.prune as it behaves (analysed), and layers made smaller (formula)."""
    amount = ctx.prune_amount
    pct = f"{amount:.0%}"
    shrunk = Fraction(amount).limit_denominator(1000) * Fraction(ctx.facts.prunable_bytes,
                                                                 max(ctx.facts.params_bytes, 1))
    return [
        analysed_row(ctx, f"prune {pct} unstructured (torch.nn.utils.prune)", {"prune_amount": amount},
                     effort=1, note="keeps weight_orig + a weight_mask buffer + the recomputed weight"),
        analysed_row(ctx, f"prune {pct} + prune.remove", {"prune_amount": amount, "prune_remove": True},
                     effort=1, note="zeros stored densely take as many bytes"),
        scaled_row(ctx, None, f"layers {pct} smaller (structured)", {"shrink": amount},
                   shrink_scaling(shrunk), effort=1,
                   note=(f"pruned layers' parameters (and gradients, optimizer state) x {1 - amount:g}; "
                         "activations kept (upper bound); needs retraining")),
    ]


def sharding_rows(ctx: PlanContext, on: Analysed | None = None) -> list[Analysed | str]:
    """ZeRO-1 (DDP + ZeroRedundancyOptimizer) and FSDP2 without resharding after forward over
    ``world_size`` GPUs; FSDP2 over 2, 4, 8, ... GPUs up to the first degree that fits (and
    ``world_size``); each analysed by running the engine (per GPU, the highest rank); CPU
    offload of the optimizer (formula).  None when the job is already parallel."""
    if ctx.job.parallel is not None:
        return []
    n = ctx.world_size
    base = dict(on.row.changes) if on is not None else {}
    prefix = f"{on.row.name} + " if on is not None else ""
    rows: list[Analysed | str] = []
    for spec, name, note in (
            (f"zero1={n}", f"ZeRO-1 over {n} GPUs (DDP + ZeroRedundancyOptimizer)", "communication as DDP"),
            (f"fsdp={n}:keep", f"FSDP2 over {n} GPUs, parameters kept after forward (ZeRO-2-like)",
             "all-gathers once per step; gradients reduce-scattered")):
        rows.append(analysed_row(ctx, prefix + name, {**base, "parallel": spec}, effort=2, note=note))
    # FSDP2 (ZeRO-3) at each power-of-two degree up to the first that fits, and at world_size
    degrees = [d for d in (2, 4, 8, 16, 32, 64, 128, 256, 512) if d < n] if on is None else []
    for degree in [*degrees, n]:
        row = analysed_row(ctx, f"{prefix}FSDP2 over {degree} GPUs (ZeRO-3)", {**base, "parallel": f"fsdp={degree}"},
                           effort=2, note="1.5x DDP's communication; all-gathers in forward and backward")
        rows.append(row)
        if isinstance(row, Analysed) and row.row.fits:
            break
    rows.append(scaled_row(ctx, on, "CPU offload of optimizer state", {"offload": "optimizer"},
                           offload_scaling(), effort=2,
                           note="optimizer step on the CPU; gradients and parameters cross PCIe every step"))
    return rows


def quantization_rows(ctx: PlanContext, on: Analysed | None = None) -> list[Analysed]:
    """int8 / int4 weight-only quantization of the Linear layers (inference; formula)."""
    weights = ctx.facts.linear_weights
    peak = (on.prediction if on is not None and on.prediction is not None else ctx.base).peak_bytes
    dtype = on.row.changes.get("dtype") if on is not None else None  # weights in the analysed run's dtype
    base_bytes = sum(r * c * (parse_dtype(dtype).itemsize if dtype else size) for r, c, size in weights)
    int8 = sum(int8_weight_bytes(r, c) for r, c, _ in weights)
    int4 = sum(int4_weight_bytes(r, c, ctx.group_size) for r, c, _ in weights)
    rows = []
    for name, quantized, note in (("int8", int8, "per-row 2-byte scales"),
                                  ("int4", int4, f"2-byte scale + zero per {ctx.group_size} weights")):
        label = f"{name} weight-only quantization (Linear)"
        row = formula_row(ctx, f"{on.row.name} + {label}" if on else label,
                          {**(on.row.changes if on else {}), "quantize": name}, peak - base_bytes + quantized,
                          effort=1, note=f"{note}; fused kernels assumed (no dequantized copy)",
                          source="analysis + formula" if on else "formula")
        rows.append(row)
    return rows


def sparse_row(ctx: PlanContext) -> Analysed:
    """Pruned weights stored as CSR sparse matrices (inference; formula)."""
    density = 1 - Fraction(ctx.prune_amount).limit_denominator(1000)
    dense = ctx.facts.prunable_bytes
    sparse = sum(csr_bytes(r, c, density, size) for r, c, size in ctx.facts.prunable_weights)
    size = ctx.facts.prunable_weights[0][2] if ctx.facts.prunable_weights else 4
    even = csr_break_even_density(size)
    return formula_row(ctx, f"prune {ctx.prune_amount:.0%} + CSR sparse weights", {"sparse": "csr"},
                       ctx.base.peak_bytes - dense + sparse, effort=1,
                       note=f"int64 indices: smaller than dense only below {float(even):.0%} density")
