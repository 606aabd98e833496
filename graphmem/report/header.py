"""Stage 4 helper: the header every text report opens with, in words a user knows.

Input: what was analysed (target, inputs, device, GPU, mode) and, when there is one, the
MemoryReport.  Output: a title line and a two-column block: the model, its parameter count
and dtypes, how many of them train (when not all do), the inputs, the optimizer (training)
and the device.

The parameter count is taken from the trace's storages with the parameter role: elements =
bytes / the dtype's item size, each storage once (tied weights share one).  With
``--parallel`` these are the storages of the rank shown (FSDP: its shards).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tabulate import tabulate

from graphmem.job.optim_formula import FORMULA_OPTIMIZERS
from graphmem.memory.results import MemoryReport, ModeReport
from graphmem.trace.records import Phase, Role

__all__ = ["optimizer_implementation", "parameter_count", "render_header"]

# a quantized weight's scales are held as "<weight>.quant_state.*" (bitsandbytes' 4-bit
# QuantState) or "<weight>.SCB" (its int8 weights' row scales)
_QUANT_STATE = ".quant_state."
_INT8_SCALES = ".SCB"


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
        counts[storage.dtype] = counts.get(storage.dtype, 0) + storage.nbytes // itemsize
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
    return f"{dtypes.strip()} ({words}{fmt(params_bytes)})"


def _inputs_text(inputs: Sequence[str]) -> str:
    # "32x1000:float32" -> "32x1000 float32"; "input_ids=2x128:int64" -> "input_ids 2x128 int64"
    return ", ".join(text.replace("=", " ").replace(":", " ") for text in inputs)


_LOSS_WORDS = {"auto": "the model's own (output.loss), else the sum of its output", "sum": "sum of the output",
               "mean": "mean of the output", "cross_entropy": "cross entropy", "nll": "negative log likelihood"}


def render_header(title: str, target: str, inputs: Sequence[str], device: str, *, gpu: str | None = None,
                  mode: str | None = None, report: MemoryReport | None = None, parallel: str | None = None,
                  fmt: Callable[[int], str] = str) -> str:
    """``title`` and one row per fact known: model, parameters, inputs, what runs, device.

    Args:
        title: the first line, e.g. ``graphmem analyze`` or ``graphmem check``.
        mode: train, inference or both (None: say nothing about it).
        report: the analysis, for the parameters and the optimizer; None when not at hand.
        fmt: bytes as text (the ``--units`` of the command).
    """
    rows = [["model", target]]
    generate = report.generate.prefill if report and report.generate else None
    modes = [m for m in ((report.train, report.inference, generate) if report else ()) if m is not None]
    if modes:
        rows.append(["parameters", _count_text(parameter_count(modes[0]), modes[0].params_bytes, fmt)
                     + (" (on the rank shown)" if parallel else "")])
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
        rows.append(["optimizer", train.optimizer + (f" ({impl})" if impl else "")])
    rows.append(["device", device + (f", {gpu}" if gpu else "")])
    if parallel:
        rows.append(["parallel", parallel])
    return f"{title}\n" + str(tabulate(rows, tablefmt="plain", disable_numparse=True))
