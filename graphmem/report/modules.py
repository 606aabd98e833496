"""Stage 4 helper: where the memory sits, by module and by tensor.

Input: one ModeReport (its trace's ops and storages, and its lifetimes).
Output: ``ModuleRow`` per module of the module tree cut at a depth (parameters, gradients,
optimizer state, activations saved for backward, bytes live at the peak), and
``TopTensor`` records for the largest storages live at the peak.

Where a storage is charged is decided in one place, ``graphmem.memory.attribution``:
parameters, buffers and gradients belong to their parameter's module by name; optimizer
state and whatever the optimizer step makes to the row ``(optimizer step)``; inputs and
targets to ``(inputs)``; the rest to the module of the op that created it, storages made by
the loss to ``(loss)`` and those made outside every module to ``(root)``.  Each storage
lands in exactly one row, so every column sums to the mode's total (``params_bytes``, ...,
``peak_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from graphmem.memory.attribution import INPUTS, LOSS, OPTIMIZER_STEP, ROOT, op_module, storage_module
from graphmem.memory.mode_report import parameter_step, reference_steps
from graphmem.memory.results import Category, ModeReport
from graphmem.records import Trace
from graphmem.report.series import live_at

__all__ = [
    "INPUTS",
    "LOSS",
    "OPTIMIZER_STEP",
    "ROOT",
    "ModuleRow",
    "TopTensor",
    "cut_module",
    "module_rows",
    "op_module",
    "storage_module",
    "top_tensors",
]


@dataclass(frozen=True, slots=True)
class ModuleRow:
    """Bytes one module (and everything under it, past the depth cut) accounts for.

    ``grads_bytes`` is counted at the end of backward, ``optimizer_state_bytes`` at the end
    of the step and ``activations_bytes`` at the end of the first loss, as the mode's
    totals are; ``peak_bytes`` is the module's share of the live set at the peak.
    """

    module: str
    params_bytes: int
    grads_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    peak_bytes: int


@dataclass(frozen=True, slots=True)
class TopTensor:
    """One storage live at the peak.  ``op`` is "" and ``created`` -1 for storages that
    exist before the first op; ``dies`` is the last op it is live after, None when it is
    still referenced when the step ends."""

    sid: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    category: Category
    label: str
    op: str
    created: int
    module: str
    dies: int | None


def cut_module(module: str, depth: int) -> str:
    """The ancestor of ``module`` at most ``depth`` levels deep ("a.b.c", 2 -> "a.b");
    the special rows ("(inputs)", ...) are left as they are."""
    if depth < 1:
        raise AssertionError(f"cut_module: depth must be >= 1, got {depth}")
    if module.startswith("("):
        return module
    return ".".join(module.split(".")[:depth])


def module_rows(mode: ModeReport, depth: int = 2) -> tuple[ModuleRow, ...]:
    """One row per module cut at ``depth``, in order of first execution ((inputs) first).

    Args:
        mode: one analysed mode.
        depth: levels of the module tree kept; deeper modules add to their ancestor.

    Returns:
        Rows whose columns sum to ``params_bytes``, ``grads_bytes``,
        ``optimizer_state_bytes``, ``activations_bytes`` and ``peak_bytes``.  Bytes.
    """
    steps = reference_steps(mode.trace)
    storages = {s.sid: s for s in mode.trace.storages}
    peak = mode.peak.step
    # column -> (category it counts or None for all, the op index it is taken at)
    columns = {"params": (Category.PARAMETER, parameter_step(mode.lifetimes, mode.trace)),
               "grads": (Category.GRADIENT, steps.end_of_backward),
               "optimizer_state": (Category.OPTIMIZER_STATE, steps.end),
               "activations": (Category.ACTIVATION, steps.end_of_loss), "peak": (None, peak)}
    sums: dict[str, dict[str, int]] = {}
    for life in mode.lifetimes:
        key = cut_module(storage_module(storages[life.sid], life.category, mode.trace), depth)
        row = sums.setdefault(key, dict.fromkeys(columns, 0))
        for column, (category, step) in columns.items():
            if step is not None and category in (None, life.category) and life.start <= step <= life.end:
                row[column] += life.nbytes
    peak_op = mode.trace.ops[peak]
    if peak_op.scratch_bytes:
        key = cut_module(op_module(mode.trace, peak), depth)
        sums.setdefault(key, dict.fromkeys(columns, 0))["peak"] += peak_op.scratch_bytes
    order = _first_seen(mode.trace, depth)
    return tuple(ModuleRow(module=key, params_bytes=v["params"], grads_bytes=v["grads"],
                           optimizer_state_bytes=v["optimizer_state"],
                           activations_bytes=v["activations"], peak_bytes=v["peak"])
                 for key, v in sorted(sums.items(), key=lambda kv: order.get(kv[0], len(order))))


def _first_seen(trace: Trace, depth: int) -> dict[str, int]:
    # rows in execution order: inputs, then modules as the forward pass reaches them
    order = {INPUTS: 0}
    for op in trace.ops:
        order.setdefault(cut_module(op_module(trace, op.index), depth), len(order))
    return order


def top_tensors(mode: ModeReport, count: int = 10) -> tuple[TopTensor, ...]:
    """The ``count`` largest storages live at the peak, largest first (ties by creation).

    Args:
        mode: one analysed mode.
        count: how many to return (fewer when fewer are live).
    """
    storages = {s.sid: s for s in mode.trace.storages}
    last = len(mode.trace.ops) - 1
    out = []
    for life in live_at(mode, mode.peak.step)[:max(count, 0)]:
        s = storages[life.sid]
        out.append(TopTensor(
            sid=s.sid, nbytes=life.nbytes, shape=s.shape, dtype=s.dtype, category=life.category,
            label=s.label, op=mode.trace.ops[s.created].op if s.created >= 0 else "", created=s.created,
            module=storage_module(s, life.category, mode.trace),
            dies=None if life.end >= last and s.released is None else life.end))
    return tuple(out)
