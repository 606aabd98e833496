"""The remedies ``graphmem plan`` tries, one builder per kind.

Input: a ``PlanContext``.  Output: rows (``Analysed``), what to analyse (``Request``: the
plan analyses them together, rows.analysed_rows) or, for a remedy that could not be
analysed, why (a str).  Each builder offers only what applies to the job: an implementation
the optimizer has, bf16 only where the target computes in it, sharding only with more than
one GPU, expandable segments only where the allocator's cached segments are part of what does
not fit.  Rows that change execution are analysed (rows.analysed_row); the others are
formulas over an analysed run's bytes (formulas.py), labelled so.
"""

from __future__ import annotations

from fractions import Fraction

from graphmem.errors import UserInputError
from graphmem.job.finetune import parse_quantize_base
from graphmem.job.optim_formula import FORMULA_OPTIMIZERS
from graphmem.job.option import spelling
from graphmem.job.spec import parse_dtype
from graphmem.preflight.changes import merge
from graphmem.preflight.footprint import expandable_conf
from graphmem.preflight.formulas import (
    csr_break_even_density,
    csr_bytes,
    int4_weight_bytes,
    int8_weight_bytes,
    shrink_scaling,
)
from graphmem.preflight.ranking import eight_bit_version
from graphmem.preflight.rows import Analysed, PlanContext, Request, formula_row, scaled_row
from graphmem.units import format_bytes

__all__ = [
    "accumulation_rows",
    "allocator_rows",
    "amp_rows",
    "checkpoint_rows",
    "half_precision_rows",
    "implementation_rows",
    "offload_rows",
    "optimizer_rows",
    "precision_rows",
    "prune_rows",
    "qlora_rows",
    "quantization_rows",
    "sharding_rows",
    "sparse_row",
]

# optimizers whose fused kernel the trace records without running it for real (fused SGD and
# Adagrad have no fake-tensor kernel in torch 2.13: they would allocate real memory)
_FUSED = frozenset({"adam", "adamw", "adam-amsgrad", "adamw-amsgrad"})
_HALF = ("bfloat16", "float16")


def _half(ctx: PlanContext) -> bool:
    """The job's weights are already in half precision."""
    dtype = ctx.job.model.dtype
    return dtype is not None and dtype.is_floating_point and dtype.itemsize < 4


def _torch_optimizer(ctx: PlanContext) -> bool:
    name = ctx.job.step.optimizer
    return name != "none" and name not in FORMULA_OPTIMIZERS and ":" not in name


def implementation_rows(ctx: PlanContext) -> list[Request | Analysed | str]:
    """The job's optimizer with its fused or foreach implementation (training): what PyTorch
    picks by default is foreach on CUDA, a for-loop on CPU."""
    if not _torch_optimizer(ctx) or ctx.job.step.optimizer == "lbfgs":
        return []
    current = ctx.job.step.optimizer_impl
    if current == "auto":
        current = "foreach" if ctx.job.device == "cuda" else "for-loop"
    notes = {"fused": "same update in fused kernels: no temporaries the size of the parameters",
             "foreach": "same update in grouped kernels"}
    impls = [i for i in ("fused", "foreach") if i != current and (i != "fused" or ctx.job.step.optimizer in _FUSED)]
    return [Request({"optimizer_impl": impl}, note=notes[impl]) for impl in impls]


def checkpoint_rows(ctx: PlanContext) -> list[Request | Analysed | str]:
    """Activation checkpointing of each repeated block class (the outermost first), and for
    the outermost: of every second block, and selectively (matmul outputs kept) (training)."""
    if ctx.job.step.checkpoint:
        return []
    rows: list[Request | Analysed | str] = [Request({"checkpoint": [cls]},
                         note="non-reentrant torch.utils.checkpoint; backward re-runs the block's forward")
            for cls in ctx.facts.block_classes[:3]]
    for cls in ctx.facts.block_classes[:1]:
        rows += [Request({"checkpoint": [cls], "checkpoint_every": 2},
                              note="half the blocks re-run their forward"),
                 Request({"checkpoint": [cls], "checkpoint_save": ["matmuls"]},
                              note="selective checkpointing: only the cheap ops are recomputed")]
    return rows


def amp_rows(ctx: PlanContext) -> list[Request | Analysed | str]:
    """bf16 / fp16 autocast (fp16 with a GradScaler when training); bf16 only on a target that
    computes in it."""
    if ctx.job.step.amp or _half(ctx):
        return []
    return [Request({"amp": amp}, note="parameters stay fp32")
            for amp in ("bf16", "fp16") if amp == "fp16" or ctx.bf16]


def precision_rows(ctx: PlanContext) -> list[Request | Analysed | str]:
    """Training with the weights in bf16: with fp32 master weights and optimizer state (mixed
    precision as trainers hold it), and without any fp32 copy."""
    if _half(ctx) or not ctx.bf16 or ctx.job.step.optimizer == "none":
        return []
    rows: list[Request | Analysed | str] = []
    if _torch_optimizer(ctx):
        rows.append(Request({"master_weights": "bfloat16"},
                                 note="forward and backward in bf16; the update in fp32 on master copies, "
                                      "with fp32 gradients at the step (Megatron-LM, DeepSpeed bf16)"))
    rows.append(Request({"dtype": "bfloat16"},
                             note="model.to(bfloat16) before the optimizer is built: updates are rounded "
                                  "to bf16 (stochastic rounding or Kahan summation recommended)"))
    return rows


def optimizer_rows(ctx: PlanContext) -> list[Request | Analysed | str]:
    """Other optimizers: the 8-bit version of the job's own (else 8-bit AdamW), SGD with
    momentum, SGD, AdamW (training)."""
    current = ctx.job.step.optimizer
    same = {"adam": "adamw"}.get(current, current)  # Adam and AdamW hold the same state
    candidates = [eight_bit_version(current) or "adamw8bit", "sgd-momentum", "sgd", "adamw"]
    names = list(dict.fromkeys(n for n in candidates if n not in (current, same)))
    skipped: list[Request | Analysed | str] = []
    if ctx.job.parallel is not None and any(n in FORMULA_OPTIMIZERS for n in names):
        # their stand-in sizes the state of the whole parameter, not of the rank's shard
        skipped.append(f"8-bit optimizers: not analysed with {spelling('parallel')} (their state is sized for whole "
                       "parameters, not for each GPU's shard)")
        names = [n for n in names if n not in FORMULA_OPTIMIZERS]
    return skipped + [Request({"optimizer": name},
                                   note="state by formula: 1 B per element per state + a float32 absmax per 256"
                                   if name in FORMULA_OPTIMIZERS else "")
                      for name in names]


def qlora_rows(ctx: PlanContext) -> list[Request | Analysed | str]:
    """A LoRA job's frozen base in 4 bits (QLoRA, nf4), where bitsandbytes is installed
    (training)."""
    tuning = ctx.job.finetune
    if tuning is None or tuning.lora is None or tuning.quantize_base is not None:
        return []
    try:
        parse_quantize_base("nf4")
    except UserInputError as exc:
        return [f"QLoRA (the base in 4 bits): not analysed; {exc}"]
    return [Request({"quantize_base": "nf4"}, note="bitsandbytes' Linear4bit as from_pretrained loads it with "
                                                  "BitsAndBytesConfig(load_in_4bit=True); the adapters unchanged")]


def accumulation_rows(ctx: PlanContext) -> list[Request | Analysed | str]:
    """The same samples per step in 2 or 4 micro-batches (training)."""
    base = ctx.job.step.grad_accum
    batch = ctx.batch or 1
    norm = "; BatchNorm normalises over each micro-batch" if ctx.facts.batch_norm else ""
    return [Request({"batch": batch // k, "grad_accum": k * base},
                         note=f"same {batch * base} samples per optimizer step{norm}")
            for k in (2, 4) if batch % k == 0]


def half_precision_rows(ctx: PlanContext) -> list[Request | Analysed | str]:
    """Weights (and float inputs) in bf16 or fp16 (inference)."""
    if _half(ctx):
        return []
    return [Request({"dtype": name}, note="float inputs converted too")
            for name in _HALF if name == "float16" or ctx.bf16]


def prune_rows(ctx: PlanContext) -> list[Request | Analysed | str]:
    """torch.nn.utils.prune as it behaves (analysed), and layers made smaller (formula)."""
    amount = ctx.prune_amount
    # a pruned module's recomputed weight is no leaf: the sharding engines' copy of the model
    # (deepcopy) refuses it, so torch.nn.utils.prune is analysed on one device only
    pruned: list[Request | Analysed | str] = [
        Request({"prune_amount": amount},
                     note="keeps weight_orig + a weight_mask buffer + the recomputed weight"),
        Request({"prune_amount": amount, "prune_remove": True},
                     note="zeros stored densely take as many bytes")] if ctx.job.parallel is None else [
        f"torch.nn.utils.prune: not analysed with {spelling('parallel')} (the sharded copy of a pruned model fails)"]
    shrunk = Fraction(amount).limit_denominator(1000) * Fraction(ctx.facts.prunable_bytes,
                                                                 max(ctx.facts.params_bytes, 1))
    return [
        *pruned,
        scaled_row(ctx, None, {"shrink": amount}, shrink_scaling(shrunk),
                   note=(f"pruned layers' parameters (and gradients, optimizer state) x {1 - amount:g}; "
                         "activations kept (upper bound); needs retraining")),
    ]


# how far each strategy shards the step's state: a row is offered only where it shards more
# than the job does already (DDP < ZeRO-1 < FSDP2 keeping parameters < FSDP2)
_SHARDING = {"ddp": 1, "zero1": 2, "fsdp:keep": 3, "fsdp": 4}


def _own_sharding(ctx: PlanContext) -> tuple[int, int] | None:
    """The job's own (sharding level, degree): (0, 1) on one GPU; None when its parallelism is
    not one strategy of _SHARDING (tensor or pipeline parallel, HSDP, the user's own function),
    which the rows would replace rather than extend."""
    spec = ctx.job.parallel
    if spec is None:
        return 0, 1
    if spec.parallelize is not None or len(spec.degrees) != 1 or spec.degrees[0][0] not in _SHARDING:
        return None
    name, degree = spec.degrees[0]
    return _SHARDING[f"{name}:keep" if name == "fsdp" and spec.reshard_after_forward is False else name], degree


def sharding_rows(ctx: PlanContext, on: Analysed | None = None) -> list[Request | Analysed | str]:
    """ZeRO-1 (DDP + ZeroRedundancyOptimizer) and FSDP2 without resharding after forward over
    ``world_size`` GPUs; FSDP2 over 2, 4, 8, ... GPUs up to the first degree that fits (and
    ``world_size``); each analysed by running the engine (per GPU, the highest rank).  Only with
    a world size (``--world-size``, or the GPUs of the job's ``--parallel``) of 2 or more, and only
    the rows that shard more than the job already does."""
    n, own = ctx.world_size, _own_sharding(ctx)
    if n is None or n < 2 or own is None:
        return []
    base = dict(on.row.changes) if on is not None else {}
    # ZeRO-1 records every distinct rank (each holds other parameters' state): the longest row, started first
    offered: list[tuple[str, int, Request]] = [
        ("zero1", n, Request({**base, "parallel": f"zero1={n}"}, note="communication as DDP", first=True)),
        ("fsdp:keep", n, Request({**base, "parallel": f"fsdp={n}:keep"},
                                 note="all-gathers once per step; gradients reduce-scattered"))]
    # FSDP2 (ZeRO-3) at each power-of-two degree up to the first that fits, and at world_size
    degrees = [d for d in (2, 4, 8, 16, 32, 64, 128, 256, 512) if d < n] if on is None else []
    offered += [("fsdp", degree, Request({**base, "parallel": f"fsdp={degree}"}, until_fit="fsdp",
                                         note="1.5x DDP's communication; all-gathers in forward and backward"))
                for degree in [*degrees, n]]
    return [request for name, degree, request in offered
            if _SHARDING[name] > own[0] or (_SHARDING[name] == own[0] and degree > own[1])]


def allocator_rows(ctx: PlanContext, on: Analysed | None = None) -> list[Request | Analysed | str]:
    """The CUDA caching allocator with expandable segments, for the job (or the analysed row
    ``on``) when it does not fit and its reserved peak is above its allocated one (the
    allocator's cached segments are part of what does not fit): analysed with
    PYTORCH_CUDA_ALLOC_CONF set so."""
    made = on.prediction if on is not None and on.prediction is not None else ctx.base
    stats = made.mode_report.allocator
    fits = on.row.fits if on is not None else ctx.budget.fits(ctx.base.peak_bytes)
    if stats is None or stats.config.expandable_segments or fits:
        return []
    if stats.reserved_peak_bytes <= stats.allocated_peak_bytes:  # no cached segment to spare
        return []
    conf = expandable_conf(ctx.job.target.alloc_conf)
    return [Request({**(dict(on.row.changes) if on is not None else {}), "alloc_conf": conf},
                    note=f"PYTORCH_CUDA_ALLOC_CONF={conf} in the job's environment: segments grow in place instead "
                         "of new ones beside the cached ones, so the reserved peak stays near the allocated one")]


def offload_rows(ctx: PlanContext, on: Analysed | None = None) -> list[Request | Analysed | str]:
    """The optimizer step and its state on the host (ZeRO-Offload), alone or on top of ``on``:
    analysed as the device's forward and backward, the gradients leaving it at the step.  Only
    from a GPU (the CPU target is the host)."""
    changes = merge(on.row.changes if on is not None else {}, {"offload": "optimizer"})
    if changes is None or ctx.job.step.optimizer == "none" or ctx.job.device != "cuda":
        return []
    return [Request(changes, noted=_offload_note)]


def _offload_note(made: Analysed) -> str:
    assert made.prediction is not None, "_offload_note: an analysed row"
    moved = format_bytes(made.prediction.mode_report.params_bytes)
    return (f"as DeepSpeed's offload_optimizer: every optimizer step, {moved} of gradients to the host and {moved} "
            "of weights back over PCIe, and the update on the CPU (FSDP2's CPUOffloadPolicy also keeps the "
            "weights there: less on the GPU)")


def quantization_rows(ctx: PlanContext, on: Analysed | None = None) -> list[Analysed]:
    """int8 / int4 weight-only quantization of the Linear layers (inference; formula)."""
    weights = ctx.facts.linear_weights
    if not weights:
        return []  # no nn.Linear (GPT-2's Conv1D layers are not what torchao quantizes)
    peak = (on.prediction if on is not None and on.prediction is not None else ctx.base).peak_bytes
    dtype = on.row.changes.get("dtype") if on is not None else None  # weights in the analysed run's dtype
    base_bytes = sum(r * c * (parse_dtype(dtype).itemsize if dtype else size) for r, c, size in weights)
    int8 = sum(int8_weight_bytes(r, c) for r, c, _ in weights)
    int4 = sum(int4_weight_bytes(r, c, ctx.group_size) for r, c, _ in weights)
    return [formula_row(ctx, {**(on.row.changes if on else {}), "quantize": name}, peak - base_bytes + quantized,
                        note=f"{note}; fused kernels assumed (no dequantized copy)",
                        source="analysis + formula" if on else "formula")
            for name, quantized, note in (("int8", int8, "per-row 2-byte scales"),
                                          ("int4", int4, f"2-byte scale + zero per {ctx.group_size} weights"))]


def sparse_row(ctx: PlanContext) -> Analysed:
    """Pruned weights stored as CSR sparse matrices (inference; formula)."""
    density = 1 - Fraction(ctx.prune_amount).limit_denominator(1000)
    dense = ctx.facts.prunable_bytes
    sparse = sum(csr_bytes(r, c, density, size) for r, c, size in ctx.facts.prunable_weights)
    size = ctx.facts.prunable_weights[0][2] if ctx.facts.prunable_weights else 4
    even = csr_break_even_density(size)
    return formula_row(ctx, {"sparse": ctx.prune_amount}, ctx.base.peak_bytes - dense + sparse,
                       note=f"int64 indices: smaller than dense only below {float(even):.0%} density")
