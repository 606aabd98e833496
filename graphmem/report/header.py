"""Stage 4 helper: the header every text report opens with, in words a user knows.

Input: what was analysed (target, inputs, device, GPU, mode), the job's settings that change
its numbers (``Settings``, from the Job by ``settings_of``) and, when there is one, the
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
from types import SimpleNamespace
from typing import Any

import torch
from tabulate import tabulate

from graphmem.job.job import Job
from graphmem.job.optim_formula import FORMULA_OPTIMIZERS
from graphmem.job.option import Declared, declared
from graphmem.job.sections import Inputs, ModelSpec, Target
from graphmem.job.step_config import StepConfig
from graphmem.memory.results import MemoryReport, ModeReport
from graphmem.records import Phase, Role

__all__ = ["Settings", "optimizer_implementation", "parameter_count", "program_settings", "render_header",
           "settings_of", "settings_to_dict"]

# a quantized weight's scales are held as "<weight>.quant_state.*" (bitsandbytes' 4-bit
# QuantState) or "<weight>.SCB" (its int8 weights' row scales)
_QUANT_STATE = ".quant_state."
_INT8_SCALES = ".SCB"


@dataclass(frozen=True, slots=True)
class Settings:
    """The settings of what was analysed, each at its place in the job's tree
    (graphmem.job.option: the path of section and field names -> its value; a section that is
    absent has none of its paths), and whether the step trains.  The header's rows and the
    JSON ``setup`` are derived from the fields' ``shown`` metadata."""

    values: Mapping[tuple[str, ...], Any] = field(default_factory=dict)
    training: bool = True

    @property
    def parallel(self) -> str | None:
        """The parallelism as ``--parallel`` takes it (None: one device)."""
        degrees = self.values.get(("parallel", "degrees"))
        return ",".join(f"{name}={degree}" for name, degree in degrees) if degrees else None


def settings_of(job: Job) -> Settings:
    """The settings of ``job`` (its preset applied)."""
    job = job.with_preset()
    return Settings(_values(job), training=job.mode != "inference" and job.generate is None)


def program_settings(optimizer: str, target: Target) -> Settings:
    """The settings of a program run (graphmem run): its optimizer and target, the rest as
    a job's defaults."""
    tree = SimpleNamespace(model=ModelSpec(), inputs=Inputs(), generate=None, mode="train", step=StepConfig(),
                           finetune=None, target=target, parallel=None)
    return Settings({**_values(tree), ("step", "optimizer"): optimizer})


def _values(job: Any) -> dict[tuple[str, ...], Any]:
    """Each setting of the tree by its path, where its section is present."""
    values: dict[tuple[str, ...], Any] = {}
    for found in declared(Job):
        owner: Any = job
        for name in found.path[:-1]:
            owner = getattr(owner, name) if owner is not None else None
        if owner is not None:
            values[found.path] = getattr(owner, found.path[-1])
    return values


def _facts(settings: Settings, found: Declared, report: MemoryReport | None) -> dict[str, Any]:
    """What a setting's ``shown`` functions are given: whether the step trains, the rank shown,
    the implementation that ran, and the setting's section (None when absent)."""
    shown = _rank_shown(report)
    train = report.train if report is not None else None
    owner = found.path[:-1]
    present = found.path in settings.values
    return {"training": settings.training, "rank_shown": shown[0] if shown else None,
            "ranks_alike": list(shown[1]) if shown else None,
            "implementation": optimizer_implementation(train) if train is not None else None,
            "section": {path[-1]: value for path, value in settings.values.items() if path[:-1] == owner}
            if present else None}


def settings_to_dict(settings: Settings, report: MemoryReport | None = None) -> dict[str, Any]:
    """The settings as JSON fields (``report``: for the implementation that ran and the rank shown)."""
    shown = sorted((found for found in declared(Job) if found.shown is not None and found.shown.key is not None),
                   key=lambda found: found.shown.at_json)  # type: ignore[union-attr]
    data: dict[str, Any] = {}
    for found in shown:
        assert found.shown is not None and found.shown.key is not None
        value = settings.values.get(found.path)
        facts = _facts(settings, found, report)
        data[found.shown.key] = found.shown.json(value, facts) if found.shown.json is not None else value
    return {**data, "assumptions": _assumptions(report)}


def _setting_rows(settings: Settings, report: MemoryReport | None, before: float, after: float) -> list[list[str]]:
    """The rows of the settings placed between ``after`` and ``before`` that say something
    (defaults are left out)."""
    rows = []
    shown = sorted((found for found in declared(Job) if found.shown is not None and found.shown.label is not None
                    and after < found.shown.at_row < before), key=lambda found: found.shown.at_row)  # type: ignore[union-attr]
    for found in shown:
        assert found.shown is not None and found.shown.label is not None
        facts = _facts(settings, found, report)
        value = settings.values.get(found.path)
        text = found.shown.row(value, facts) if found.shown.row is not None else ("" if value is None else str(value))
        if text:
            rows.append([found.shown.label, text])
    return rows


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


def _kwargs_text(setup: Settings | None) -> str:
    kwargs = setup.values.get(("step", "optimizer_kwargs")) if setup is not None else None
    if not kwargs:
        return ""
    return "; " + ", ".join(f"{key}={value}" for key, value in kwargs.items())


# the settings' rows (their ``shown(at_row=...)``) below this come before the device row, the others after
_DEVICE_ROW = 50

_LOSS_WORDS = {"auto": "the model's own (output.loss), else the sum of its output",
               "output.loss": "the model's own (output.loss)", "losses": "the sum of the model's losses",
               "output": "the sum of the model's output (it returns no loss)", "sum": "sum of the output",
               "mean": "mean of the output", "cross_entropy": "cross entropy", "nll": "negative log likelihood"}


def render_header(title: str, target: str, inputs: Sequence[str], device: str, *, gpu: str | None = None,
                  mode: str | None = None, report: MemoryReport | None = None, parallel: str | None = None,
                  fmt: Callable[[int], str] = str, setup: Settings | None = None) -> str:
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
    elif setup is not None and setup.training and mode != "inference" and setup.values.get(("step", "optimizer")):
        chosen = setup.values.get(("step", "optimizer_impl"), "auto")
        impl = f" ({chosen})" if chosen != "auto" else ""
        rows.append(["optimizer", setup.values[("step", "optimizer")] + impl + _kwargs_text(setup)])
    rows += _setting_rows(setup, report, before=_DEVICE_ROW, after=-math.inf) if setup is not None else []
    rows.append(["device", device + (f", {gpu}" if gpu else "")])
    if setup is not None:
        rows += _setting_rows(setup, report, before=math.inf, after=_DEVICE_ROW)
    elif parallel:
        rows.append(["parallel", parallel])
    return f"{title}\n" + str(tabulate(rows, tablefmt="plain", disable_numparse=True))
