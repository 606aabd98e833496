"""Stage 4 helper: the header every text report opens with, in words a user knows.

Input: what was analysed (target, inputs, device, GPU, mode), the job's settings that change
its numbers (a ``Setup``, from the Job by ``setup_of``) and, when there is one, the
MemoryReport.  Output: a title line and a two-column block: the model, its parameter count
and dtypes, how many of them train (when not all do), the inputs, the optimizer (training),
the weights' dtype, autocast, checkpointing, accumulation, the device and its allocator
settings, the parallelism and the rank shown, and the values assumed.

The parameter count is taken from the trace's storages with the parameter role: elements =
bytes / the dtype's item size, each storage once (tied weights share one).  With
``--parallel`` these are the storages of the rank shown (FSDP: its shards).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tabulate import tabulate

from graphmem.cuda.alloc_conf import alloc_conf_from_environment
from graphmem.job.grammar import format_blocks, format_units
from graphmem.job.job import Job
from graphmem.job.optim_formula import FORMULA_OPTIMIZERS
from graphmem.memory.results import MemoryReport, ModeReport
from graphmem.records import Phase, Role

__all__ = ["Setup", "optimizer_implementation", "parameter_count", "render_header", "setup_of", "setup_to_dict"]

# a quantized weight's scales are held as "<weight>.quant_state.*" (bitsandbytes' 4-bit
# QuantState) or "<weight>.SCB" (its int8 weights' row scales)
_QUANT_STATE = ".quant_state."
_INT8_SCALES = ".SCB"


@dataclass(frozen=True, slots=True)
class Setup:
    """The job's settings that change its numbers, as the user gave them (``setup_of``).

    Attributes:
        training: the step trains (an optimizer, autocast's GradScaler, accumulation apply).
        optimizer / optimizer_impl / optimizer_kwargs: ``--optimizer``, ``--optimizer-impl``
            (auto: PyTorch's pick) and ``--optimizer-kwargs``.
        dtype: ``model.to(dtype)`` (``--dtype`` or the preset's); None: as the model builds it.
        amp: ``--amp`` (bf16, fp16); checkpoint, checkpoint_every, checkpoint_save,
            checkpoint_blocks: ``--checkpoint*``.
        grad_accum: ``--grad-accum``.
        parallel / world_size: ``--parallel`` and the GPUs it spans (None: one).
        gpu: the CUDA target's GPU (None on cpu); alloc_conf: the PYTORCH_CUDA_ALLOC_CONF it
            runs under ("" when unset); alloc_conf_source: "--alloc-conf" or "the environment".
        sdpa: ``--sdpa``; assume: ``--assume`` (input name, value).
    """

    training: bool = True
    optimizer: str = "adam"
    optimizer_impl: str = "auto"
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    amp: str | None = None
    checkpoint: tuple[str, ...] = ()
    checkpoint_every: int = 1
    checkpoint_save: tuple[str, ...] = ()
    checkpoint_blocks: tuple[int, ...] = ()
    checkpoint_save_blocks: tuple[int, ...] = ()
    checkpoint_save_in: tuple[tuple[int, tuple[str, ...]], ...] = ()
    fsdp_keep_units: tuple[int, ...] = ()
    grad_accum: int = 1
    parallel: str | None = None
    world_size: int | None = None
    gpu: str | None = None
    alloc_conf: str = ""
    alloc_conf_source: str = ""
    sdpa: str = "auto"
    assume: tuple[tuple[str, str], ...] = ()


def allocator_setting(given: str | None) -> tuple[str, str]:
    """The allocator settings a CUDA job runs under and where they come from: ``--alloc-conf``
    when given, else the environment's ("" when neither sets any)."""
    if given is not None:
        return given, "--alloc-conf"
    return alloc_conf_from_environment(), "the environment"


def setup_of(job: Job) -> Setup:
    """The settings of ``job`` (its preset applied) that change its numbers."""
    job = job.with_preset()
    step = job.step
    conf, source = allocator_setting(job.alloc_conf)
    return Setup(training=job.mode != "inference" and job.generate is None, optimizer=step.optimizer,
                 optimizer_impl=step.optimizer_impl, optimizer_kwargs=dict(step.optimizer_kwargs),
                 dtype=str(job.dtype).removeprefix("torch.") if job.dtype is not None else None, amp=step.amp,
                 checkpoint=step.checkpoint, checkpoint_every=step.checkpoint_every,
                 checkpoint_save=step.checkpoint_save, checkpoint_blocks=step.checkpoint_blocks,
                 checkpoint_save_blocks=step.checkpoint_save_blocks, checkpoint_save_in=step.checkpoint_save_in,
                 grad_accum=step.grad_accum,
                 parallel=job.parallel.text if job.parallel else None,
                 fsdp_keep_units=job.parallel.keep_units if job.parallel else (),
                 world_size=job.parallel.world_size if job.parallel else None,
                 gpu=job.gpu if job.device == "cuda" else None,
                 alloc_conf=(conf or "") if job.device == "cuda" else "",
                 alloc_conf_source=source if job.device == "cuda" and conf else "", sdpa=job.sdpa,
                 assume=tuple(sorted(job.assume.items())))


def setup_to_dict(setup: Setup, report: MemoryReport | None = None) -> dict[str, Any]:
    """The settings as JSON fields (``report``: for the implementation that ran and the rank shown)."""
    train = report.train if report is not None else None
    ran = optimizer_implementation(train) if train is not None else None
    shown = _rank_shown(report)
    return {"optimizer": setup.optimizer if setup.training else None,
            "optimizer_impl": (ran or setup.optimizer_impl) if setup.training else None,
            "optimizer_kwargs": dict(setup.optimizer_kwargs) if setup.training else None,
            "dtype": setup.dtype, "amp": setup.amp,
            "checkpoint": {"classes": list(setup.checkpoint), "every": setup.checkpoint_every,
                           "save": list(setup.checkpoint_save),
                           **({"blocks": list(setup.checkpoint_blocks)} if setup.checkpoint_blocks else {}),
                           **({"save_blocks": list(setup.checkpoint_save_blocks)}
                              if setup.checkpoint_save_blocks else {}),
                           **({"save_in": {str(b): list(names) for b, names in setup.checkpoint_save_in}}
                              if setup.checkpoint_save_in else {})}
            if setup.checkpoint and setup.training else None,
            "grad_accum": setup.grad_accum if setup.training else None,
            "parallel": {"spec": setup.parallel, "world_size": setup.world_size,
                         "rank_shown": shown[0] if shown else None,
                         "ranks_alike": list(shown[1]) if shown else None,
                         **({"fsdp_keep_units": list(setup.fsdp_keep_units)} if setup.fsdp_keep_units else {})}
            if setup.parallel else None,
            "alloc_conf": setup.alloc_conf if setup.gpu else None, "sdpa": setup.sdpa,
            "assume": dict(setup.assume), "assumptions": _assumptions(report)}


def _rank_shown(report: MemoryReport | None) -> tuple[int, tuple[int, ...]] | None:
    """The rank whose numbers the report shows (the highest), and the ranks alike to it."""
    modes = [m for m in ((report.train, report.inference) if report else ()) if m is not None and m.ranks]
    return (modes[0].ranks[0].rank, modes[0].ranks[0].ranks) if modes else None


def _assumptions(report: MemoryReport | None) -> list[str]:
    """What the analysis assumed about values it could not know (each once)."""
    if report is None:
        return []
    modes = [report.train, report.inference, *((report.generate.prefill, report.generate.decode)
                                               if report.generate else ())]
    return sorted({a for m in modes if m is not None for a in m.assumptions})


def _ranks_text(ranks: Sequence[int]) -> str:
    # (0, 1, 2, 3) -> "0-3"; (0, 2) -> "0, 2"
    ordered = sorted(ranks)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ", ".join(map(str, ordered))


def _setup_rows(setup: Setup) -> list[list[str]]:
    """The settings' rows that say something (defaults are left out)."""
    rows = []
    if setup.dtype:
        rows.append(["weights dtype", f"{setup.dtype} (model.to)"])
    if setup.amp:
        scaler = " + GradScaler" if setup.amp == "fp16" and setup.training else ""
        rows.append(["autocast", f"{setup.amp} (torch.autocast{scaler})"])
    if setup.checkpoint and setup.training:
        every = {1: "", 2: "2nd "}.get(setup.checkpoint_every, f"{setup.checkpoint_every}th ")
        saved = f"; keeps the outputs of {', '.join(setup.checkpoint_save)}" if setup.checkpoint_save else ""
        if setup.checkpoint_save_blocks:
            saved += f" in blocks {format_blocks(setup.checkpoint_save_blocks)}"
        for block, names in setup.checkpoint_save_in:
            saved += f"; block {block} keeps the outputs of {', '.join(names)}"
        which = (f"blocks {format_blocks(setup.checkpoint_blocks)} of the {', '.join(setup.checkpoint)} modules"
                 if setup.checkpoint_blocks else f"every {every}{', '.join(setup.checkpoint)}")
        rows.append(["checkpointing", which + saved])
    if setup.grad_accum > 1 and setup.training:
        rows.append(["accumulation", f"{setup.grad_accum} micro-batches per optimizer step"])
    return rows


def _device_rows(setup: Setup, report: MemoryReport | None) -> list[list[str]]:
    """The allocator's settings (always, on the CUDA target), the attention kernels, the
    parallelism and the rank shown, the values assumed."""
    rows = []
    if setup.gpu:
        rows.append(["allocator", f"PYTORCH_CUDA_ALLOC_CONF={setup.alloc_conf} (from {setup.alloc_conf_source})"
                     if setup.alloc_conf else "PyTorch's defaults (PYTORCH_CUDA_ALLOC_CONF unset)"])
        if setup.sdpa != "auto":
            rows.append(["attention", f"{setup.sdpa} kernels (--sdpa)"])
    if setup.parallel:
        shown = _rank_shown(report)
        alike = f" (ranks {_ranks_text(shown[1])} alike)" if shown and len(shown[1]) > 1 else ""
        rank = f"; the numbers are rank {shown[0]}'s, the highest peak{alike}" if shown else ""
        rows.append(["parallel", f"{setup.parallel} over {setup.world_size} GPUs{rank}"])
        if setup.fsdp_keep_units:
            keeps = "keeps its" if len(setup.fsdp_keep_units) == 1 else "keep their"
            rows.append(["FSDP2", f"{format_units(setup.fsdp_keep_units)} {keeps} parameters after forward"])
    if setup.assume:
        rows.append(["assumed", ", ".join(f"{name}={value}" for name, value in setup.assume)])
    return rows


def _is_scale(label: str) -> bool:
    return _QUANT_STATE in label or label.endswith(_INT8_SCALES)


def parameter_count(mode: ModeReport) -> dict[str, int]:
    """Elements of the parameters by dtype name (``{"float32": 550600}``), each storage once."""
    counts: dict[str, int] = {}
    held = [s for s in mode.trace.storages if Role.PARAMETER in s.roles]
    quantized = {s.label.partition(_QUANT_STATE)[0] for s in held if _QUANT_STATE in s.label}
    for storage in held:
        if _is_scale(storage.label):
            continue  # a quantized weight's scales: bytes of the weights, not parameters
        if storage.label in quantized and storage.dtype == "uint8":
            counts["4-bit"] = counts.get("4-bit", 0) + 2 * storage.nbytes  # two to a byte
            continue
        itemsize = getattr(torch, storage.dtype).itemsize
        # a storage that takes no allocated bytes (memory-mapped from a checkpoint, or on the
        # host on a GPU) still holds its parameters: counted by their shape
        elements = storage.nbytes // itemsize or math.prod(storage.shape)
        counts[storage.dtype] = counts.get(storage.dtype, 0) + elements
    return counts


def optimizer_implementation(mode: ModeReport) -> str | None:
    """Which torch.optim implementation ran, read off the optimizer phase's ops: ``fused``
    (``aten._fused_adam_`` and kin), ``foreach`` (``aten._foreach_*``) or ``for-loop``;
    None without an optimizer phase or for optimizers modelled by formula."""
    ops = [op.op for op in mode.trace.ops if op.phase == Phase.OPTIMIZER]
    if not ops or mode.optimizer in FORMULA_OPTIMIZERS:
        return None
    if any(name.startswith("aten._fused_") for name in ops):
        return "fused"
    return "foreach" if any(name.startswith("aten._foreach_") for name in ops) else "for-loop"


def _count_text(counts: dict[str, int], params_bytes: int, fmt: Callable[[int], str]) -> str:
    # "550,600 float32 (2.10 MiB)"; "6,658,859,008 bfloat16 (6.66 billion; 12.40 GiB)"
    total = sum(counts.values())
    words = (f"{total / 1e9:.2f} billion; " if total >= 10**9 else
             f"{total / 1e6:.1f} million; " if total >= 10**6 else "")
    dtypes = " + ".join(f"{n:,} {d}" for d, n in counts.items()) if len(counts) > 1 else f"{total:,} {''.join(counts)}"
    where = ": none allocated, memory-mapped from a file or on the host" if total and not params_bytes else ""
    return f"{dtypes.strip()} ({words}{fmt(params_bytes)}{where})"


def _inputs_text(inputs: Sequence[str]) -> str:
    # "32x1000:float32" -> "32x1000 float32"; "input_ids=2x128:int64" -> "input_ids 2x128 int64"
    return ", ".join(text.replace("=", " ").replace(":", " ") for text in inputs)


def _kwargs_text(setup: Setup | None) -> str:
    if setup is None or not setup.optimizer_kwargs:
        return ""
    return "; " + ", ".join(f"{key}={value}" for key, value in setup.optimizer_kwargs.items())


_LOSS_WORDS = {"auto": "the model's own (output.loss), else the sum of its output", "sum": "sum of the output",
               "mean": "mean of the output", "cross_entropy": "cross entropy", "nll": "negative log likelihood"}


def render_header(title: str, target: str, inputs: Sequence[str], device: str, *, gpu: str | None = None,
                  mode: str | None = None, report: MemoryReport | None = None, parallel: str | None = None,
                  fmt: Callable[[int], str] = str, setup: Setup | None = None) -> str:
    """``title`` and one row per fact known: model, parameters, inputs, what runs, device.

    Args:
        title: the first line, e.g. ``graphmem analyze`` or ``graphmem check``.
        mode: train, inference or both (None: say nothing about it).
        report: the analysis, for the parameters and the optimizer; None when not at hand.
        fmt: bytes as text (the ``--units`` of the command).
        setup: the job's settings (None: only what the report shows).
    """
    program = report.program if report is not None else None
    rows = [["program", program], ["model", target]] if program else [["model", target]]
    generate = report.generate.prefill if report and report.generate else None
    modes = [m for m in ((report.train, report.inference, generate) if report else ()) if m is not None]
    if modes:
        shown = _rank_shown(report)
        on = f" (on rank {shown[0]})" if setup is not None and shown else " (on the rank shown)"
        rows.append(["parameters", _count_text(parameter_count(modes[0]), modes[0].params_bytes, fmt)
                     + (on if parallel else "")])
    trained = report.trained if report and report.train else None
    if trained is not None and (trained.how or trained.trainable < trained.total):
        share = f"{100 * trained.trainable / trained.total:.2f}%" if trained.total else "0%"
        rows.append(["trained", f"{trained.trainable:,} of {trained.total:,} parameters ({share})"
                     + (f"; {trained.how}" if trained.how else "")])
    if inputs:
        rows.append(["inputs", _inputs_text(inputs)])
    if mode is not None:
        rows.append(["analysed", {"both": "inference and training", "train": "training"}.get(mode, mode)])
    train = report.train if report else None
    if train is not None and report is not None and report.loss:
        rows.append(["loss", _LOSS_WORDS.get(report.loss, report.loss)])
    if train is not None and train.optimizer:
        impl = optimizer_implementation(train)
        rows.append(["optimizer", train.optimizer + (f" ({impl})" if impl else "") + _kwargs_text(setup)])
    elif setup is not None and setup.training and mode != "inference" and setup.optimizer:
        impl = f" ({setup.optimizer_impl})" if setup.optimizer_impl != "auto" else ""
        rows.append(["optimizer", setup.optimizer + impl + _kwargs_text(setup)])
    rows += _setup_rows(setup) if setup is not None else []
    rows.append(["device", device + (f", {gpu}" if gpu else "")])
    if setup is not None:
        rows += _device_rows(setup, report)
    elif parallel:
        rows.append(["parallel", parallel])
    return f"{title}\n" + str(tabulate(rows, tablefmt="plain", disable_numparse=True))
