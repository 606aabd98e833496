"""A row of ``graphmem plan`` and how it is computed: analysed, or by formula.

Input: a ``PlanContext`` (the job, its budget, the analysed baseline, the model's structure)
and a row's changes (graphmem/preflight/changes.py).  Output: ``PlanRow`` values.  Rows that
change execution are analysed with analyze() (the real PyTorch code on fake tensors); the
others apply a formula from formulas.py to an analysed run's own bytes, and say "formula".
The remedies themselves are listed in remedies.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from graphmem.errors import GraphmemError
from graphmem.job.job import Job
from graphmem.job.load import ModelSource
from graphmem.job.optim_formula import FORMULA_OPTIMIZERS
from graphmem.job.spec import InputSpec, parse_input_spec
from graphmem.memory.results import ModeReport, without_graphs
from graphmem.preflight.budget import Budget
from graphmem.preflight.changes import describe
from graphmem.preflight.edits import apply_edits, edits_of
from graphmem.preflight.formulas import Scaling, scaled_peak
from graphmem.preflight.model_facts import ModelFacts, pruned_factory
from graphmem.preflight.ranking import departure, effort
from graphmem.preflight.search import Prediction, predict
from graphmem.process import progress
from graphmem.process.workers import fork_map, processes

__all__ = [
    "Analysed",
    "PlanContext",
    "PlanRow",
    "Request",
    "analysed_row",
    "analysed_rows",
    "batch_templates",
    "formula_row",
    "job_with",
    "recorded_samples",
    "scaled_row",
]

BATCH = "B"


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One remedy (or combination) and its prediction.

    Attributes:
        name: what to do, in words (graphmem/preflight/changes.py names every row).
        changes: the same as data (the kinds in graphmem/preflight/changes.py).
        peak_bytes: the bytes compared with the budget (graphmem/preflight/footprint.py: on
            cuda the reserved peak + the CUDA context and NCCL buffers).
        saving_bytes: baseline peak minus this peak (negative: it adds memory).
        extra_compute: FLOPs per sample over the baseline's, minus 1 (0.33: a third more);
            None when unknown.
        source: "analysis", "formula" or "analysis + formula".
        effort: 0 a flag or a setting, 1 changes the weights, 2 needs more hardware (GPUs,
            host memory for offload): graphmem/preflight/ranking.py, ``effort``.
        departure: how far it departs from what is trained (graphmem/preflight/ranking.py,
            ``Departure``: 0 the same math ... 7 other weights).
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
    departure: int = 0


@dataclass(frozen=True, slots=True)
class PlanContext:
    """Everything the row builders share."""

    job: Job                       # the baseline; job.model.target is resolved (no strings)
    source: ModelSource
    budget: Budget
    base: Prediction               # the baseline, analysed in job.mode
    batch: int | None              # the baseline's batch (first input's first dimension)
    templates: tuple[str, ...]     # the inputs with the batch dimension written B
    facts: ModelFacts
    world_size: int | None = None  # GPUs the sharding rows may use (--world-size, else --parallel's; None: one)
    prune_amount: float = 0.5
    group_size: int = 128
    bf16: bool = True              # the target computes in bf16 (CPU, or a GPU of compute capability 8.0+)

    @property
    def samples(self) -> int:
        """Samples in the baseline's recorded FLOPs (see recorded_samples)."""
        return recorded_samples(self.job.mode, self.batch or 1, self.job.step.grad_accum)

    @property
    def mode(self) -> str:
        """"train" or "inference" (generation counts as inference)."""
        return "train" if self.job.mode == "train" and self.job.generate is None else "inference"

    def name(self, changes: Mapping[str, Any]) -> str:
        """The row's name, from its changes."""
        return describe(changes, self.job.step.optimizer, self.mode, self.job.device)

    def departure(self, changes: Mapping[str, Any]) -> int:
        return int(departure(changes, self.mode, self.job.step.optimizer, batch_norm=self.facts.batch_norm))


@dataclass(frozen=True, slots=True)
class Analysed:
    """A row and the analysis behind it (None for formula rows)."""

    row: PlanRow
    prediction: Prediction | None


def recorded_samples(mode: str, batch: int, grad_accum: int) -> int:
    """Samples per recorded iteration: the trace records min(grad_accum, 2) micro-steps per
    optimizer step (the later ones repeat the second exactly; graphmem/trace/recording.py)."""
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


def job_with(ctx: PlanContext, changes: Mapping[str, Any]) -> Job:
    """The baseline job with ``changes`` (the analysed kinds) applied, as typed edits of its
    sections (graphmem/preflight/edits.py)."""
    def pruned(amount: float, remove: bool) -> Callable[[], Any]:
        # the pruned model is a factory of its own: the preset's class and config are in it
        return pruned_factory(ctx.source, ctx.job.model.kwargs, amount, remove, ctx.job.model.hf_config,
                              ctx.job.device)

    return apply_edits(ctx.job, edits_of(changes, ctx.templates, BATCH, ctx.batch or 1, pruned))


def _mode(prediction: Prediction) -> ModeReport:
    return prediction.mode_report


def analysed_row(ctx: PlanContext, changes: Mapping[str, Any], *, name: str = "", note: str = "",
                 prediction: Prediction | None = None) -> Analysed | str:
    """Analyse the job with ``changes`` (``prediction``: already analysed); a row, or why it
    could not be analysed.  Its source is "analysis + formula" when the optimizer's state is
    sized by formula (bitsandbytes)."""
    name = name or ctx.name(changes)
    source = "analysis + formula" if changes.get("optimizer") in FORMULA_OPTIMIZERS else "analysis"
    try:
        # a row is its peak: the same step without checkpointing (the report's comparison) is not analysed
        prediction = prediction or predict(job_with(ctx, changes), checkpoint_comparison=False)
    except GraphmemError as exc:
        return f"{name}: not analysed ({exc})"
    samples = recorded_samples(ctx.job.mode, int(changes.get("batch", ctx.batch or 1)),
                               int(changes.get("grad_accum", ctx.job.step.grad_accum)))
    base = _mode(ctx.base)
    extra = (_mode(prediction).flops * ctx.samples) / (base.flops * samples) - 1 if base.flops else None
    row = PlanRow(name=name, changes=dict(changes), peak_bytes=prediction.peak_bytes,
                  saving_bytes=ctx.base.peak_bytes - prediction.peak_bytes, extra_compute=extra,
                  fits=ctx.budget.fits(prediction.peak_bytes), source=source, effort=effort(changes), note=note,
                  departure=ctx.departure(changes))
    return Analysed(row, prediction)


@dataclass(frozen=True, slots=True)
class Request:
    """A row to analyse: its changes, and its name and note when not the default ones.

    Attributes:
        noted: the note, made from the analysed row (here, after the analysis).
        first: started before the others (a recording per rank: the longest), so that the
            worker processes end together.
        until_fit: a group name: the group's rows after the first that fits are left out
            (FSDP2 at each degree up to the fewest GPUs that fit; all analysed side by side).
    """

    changes: Mapping[str, Any]
    name: str = ""
    note: str = ""
    noted: Callable[[Analysed], str] | None = None
    first: bool = False
    until_fit: str = ""


def _analyse(item: tuple[PlanContext, Request, str, int]) -> Analysed | str:
    ctx, request, label, _ = item
    with progress.labelled(label):
        return analysed_row(ctx, request.changes, name=request.name, note=request.note)


def _analyse_in_worker(item: tuple[PlanContext, Request, str, int]) -> Analysed | str:
    """One request, in a worker process: its report travels back without its fx graphs.  The
    worker shows no progress of its own (the parent, pid ``item[3]``, names each row as it
    comes back)."""
    if os.getpid() != item[3]:
        progress.mute()
    made = _analyse(item)
    if isinstance(made, str) or made.prediction is None:
        return made
    return Analysed(made.row, Prediction(made.prediction.peak_bytes, without_graphs(made.prediction.report)))


def analysed_rows(ctx: PlanContext, items: Sequence[Request | Analysed | str], *, stage: str = ""
                  ) -> list[Analysed | str]:
    """``items`` with each Request analysed (analysed_row), in order (see Request).  With more
    than one core the analyses run in forked worker processes (graphmem.process.workers): each is a
    recording of its own, independent of the others.  Progress names each row "row k/N"
    (``stage``: which of plan's rounds of rows, in words)."""
    asked = {i: item for i, item in enumerate(items) if isinstance(item, Request)}
    requests = sorted(asked, key=lambda i: not asked[i].first)
    work = [(ctx, asked[i], _row_label(ctx, asked[i], k, len(requests), stage), os.getpid())
            for k, i in enumerate(requests, 1)]
    alone = processes() <= 1 or len(work) <= 1  # here, with the graphs: no worker, nothing to pickle
    if not alone and work and progress.active():
        progress.show(f"{stage or 'rows'}: analysing {len(work)} rows in {min(processes(), len(work))} "
                      "worker processes")
    ended: list[int] = []

    def ended_one(index: int, row: Analysed | str) -> None:
        ended.append(index)
        if progress.active():
            progress.show(f"{work[index][2]} — done ({len(ended)} of {len(work)} done)")

    made = fork_map(_analyse if alone else _analyse_in_worker, work, what="analysing a plan row", done=ended_one)
    done = dict(zip(requests, made, strict=True))
    out: list[Analysed | str] = []
    fitted: set[str] = set()
    for i, item in enumerate(items):
        if not isinstance(item, Request):
            out.append(item)
            continue
        if item.until_fit and item.until_fit in fitted:
            continue
        row = done[i]
        if isinstance(row, Analysed) and item.noted is not None:
            row = Analysed(replace(row.row, note=item.noted(row)), row.prediction)
        if isinstance(row, Analysed) and row.row.fits and item.until_fit:
            fitted.add(item.until_fit)
        out.append(row)
    return out


def _row_label(ctx: PlanContext, request: Request, k: int, n: int, stage: str) -> str:
    """``row 3/12 (each change alone): checkpoint every Block``: which row progress lines are about."""
    return f"row {k}/{n}{f' ({stage})' if stage else ''}: {request.name or ctx.name(request.changes)}"


def formula_row(ctx: PlanContext, changes: Mapping[str, Any], peak: int, *, note: str,
                source: str = "formula", extra_compute: float | None = 0.0) -> Analysed:
    """A row whose peak comes from a formula."""
    row = PlanRow(name=ctx.name(changes), changes=dict(changes), peak_bytes=peak,
                  saving_bytes=ctx.base.peak_bytes - peak, extra_compute=extra_compute,
                  fits=ctx.budget.fits(peak), source=source, effort=effort(changes), note=note,
                  departure=ctx.departure(changes))
    return Analysed(row, None)


def scaled_row(ctx: PlanContext, on: Analysed | None, changes: Mapping[str, Any], scaling: Scaling,
               *, note: str) -> Analysed:
    """A formula row that rescales the categories of an analysed run (the baseline by default)."""
    prediction = on.prediction if on is not None and on.prediction is not None else ctx.base
    mode = _mode(prediction)
    overhead = prediction.peak_bytes - mode.peak_bytes  # CUDA: allocator rounding and workspaces
    peak = scaled_peak(mode.lifetimes, [op.phase for op in mode.trace.ops],
                       [op.scratch_bytes for op in mode.trace.ops], scaling) + overhead
    merged = {**(on.row.changes if on is not None else {}), **changes}
    return formula_row(ctx, merged, peak, note=note,
                       source="analysis + formula" if on is not None else "formula",
                       extra_compute=on.row.extra_compute if on is not None else 0.0)
