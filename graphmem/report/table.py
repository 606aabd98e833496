"""Stage 4: the table renderer.  MemoryReport -> plain-text tables (tabulate)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tabulate import tabulate

from graphmem.job.optim_formula import FORMULA_OPTIMIZERS
from graphmem.job.option import spelling
from graphmem.memory.results import Category, MemoryReport, ModeReport
from graphmem.records import Phase
from graphmem.report.cuda_section import cuda_table
from graphmem.report.generate_section import generate_table
from graphmem.report.header import Settings, render_header
from graphmem.report.module_table import render_module_sections
from graphmem.report.parallel_section import parallel_table
from graphmem.report.program_section import program_failure_line, program_files_table
from graphmem.report.scratch_note import scratch_note
from graphmem.units import format_bytes

__all__ = ["render_table", "module_label"]


def module_label(module: str, phase: str, root: str) -> str:
    """A module path for people: the root module and the loss get names, not ''."""
    if module:
        return module
    return "(loss)" if phase == Phase.LOSS else f"(root {root})"


def render_table(report: MemoryReport, units: str = "auto", *, depth: int = 2, top: int = 10,
                 setup: Settings | None = None) -> str:
    """Summary, breakdown at each peak, per-phase peaks, where each peak happens, and where the
    memory goes: a sparkline, a per-module table ``depth`` levels deep, the ``top`` largest
    storages at the peak (of the training mode when analysed, else inference).  ``setup``: the
    job's settings, for the header."""
    fmt = lambda n: format_bytes(n, units)
    if report.generate is not None:
        return generate_table(report, report.generate, fmt)
    modes = [m for m in (report.inference, report.train) if m is not None]
    root = report.target.rpartition(":")[2] or report.target
    head = [""] + [_title(m) for m in modes]
    title = "graphmem run" if report.program else "graphmem analyze"
    parts = [render_header(title, report.target, report.inputs, report.device,
                           gpu=report.gpu.name if report.gpu else None, report=report, parallel=report.parallel,
                           fmt=fmt, setup=setup)]
    summary = [["peak"] + [fmt(m.peak_bytes) for m in modes]]
    if report.ratio is not None:
        summary.append(["train / inference", "", f"{report.ratio:.2f}x"])
    parts.append(tabulate(summary, headers=head, tablefmt="simple") + unseen_line(modes))
    failure = program_failure_line(report)
    if failure:
        parts.append(failure)
    rows = [[str(c)] + [fmt(m.breakdown[c]) for m in modes] for c in Category
            if c != Category.COMMUNICATION or any(m.breakdown[c] for m in modes)]
    rows.append(["total"] + [fmt(sum(m.breakdown.values())) for m in modes])
    parts.append("Live at the peak, by category\n" + tabulate(rows, headers=head, tablefmt="simple"))
    where = [["op"] + [m.peak.op_name for m in modes],
             ["module"] + [module_label(m.peak.module, m.peak.phase, root) for m in modes],
             ["phase"] + [f"{m.peak.phase} (iteration {m.peak.iteration + 1})" for m in modes],
             ["op index"] + [f"{m.peak.step} of {m.num_ops}" for m in modes]]
    if any(_line_of(m, m.peak.step) for m in modes):  # graphmem run: the program's own line
        where.append(["program line"] + [_line_of(m, m.peak.step) or "-" for m in modes])
    parts.append("Where the peak happens\n" + tabulate(where, headers=head, tablefmt="simple"))
    cuda = cuda_table(report, modes, head, fmt)
    if cuda:
        parts.append(cuda)
    parts.extend(parallel_table(report, m, fmt) for m in modes if m.ranks)
    if report.train is not None:
        parts.append(_train_details(report.train, fmt))
    if report.train is not None and report.train_without_checkpoint is not None:
        parts.append(_checkpoint_comparison(report.train, report.train_without_checkpoint, fmt))
    for note in sorted({a for m in modes for a in m.assumptions}):
        parts.append(f"Assumed: {note}")
    parts.extend(render_module_sections(report, units, depth, top))
    files = program_files_table(report, fmt)
    if files:
        parts.append(files)
    scratch = scratch_note({op for m in modes for op in m.unmodeled_ops}, report.device)
    if scratch:
        parts.append(scratch)
    return "\n\n".join(parts) + "\n"


def _checkpoint_comparison(with_ck: ModeReport, without: ModeReport, fmt: Callable[[int], str]) -> str:
    """The --checkpoint what-if: both peaks and the recompute cost."""
    share = with_ck.recompute_flops / without.flops if without.flops else 0.0
    rows = [["without checkpointing", fmt(without.peak_bytes), f"{without.flops:,}", ""],
            ["with checkpointing", fmt(with_ck.peak_bytes), f"{with_ck.flops:,}",
             f"{with_ck.recompute_flops:,} ({share:.1%})"]]
    return str("Activation checkpointing what-if (FLOPs of both iterations)\n"
            + tabulate(rows, headers=["", "train peak", "FLOPs", "recomputed FLOPs"], tablefmt="simple"))


def _title(m: ModeReport) -> str:
    return "inference" if m.mode == "inference" else f"train ({m.optimizer})"


def _train_details(m: ModeReport, fmt: object) -> str:
    f = fmt if callable(fmt) else str
    phases = [[p.phase, f(p.peak_bytes)] for p in m.phases]
    phases += [["first step (creates optimizer state)", f(m.iteration_peaks[0])],
               ["steady state (second step)", f(m.iteration_peaks[-1])]]
    source = " (formula)" if m.optimizer in FORMULA_OPTIMIZERS else ""
    totals = [["parameters", f(m.params_bytes)], ["buffers", f(m.buffers_bytes)],
              ["gradients", f(m.grads_bytes)], [f"optimizer state{source}", f(m.optimizer_state_bytes)],
              ["activations saved for backward (end of forward)", f(m.activations_bytes)]]
    return str("Training peak by phase\n" + tabulate(phases, headers=["phase", "peak"], tablefmt="simple")
            + "\n\nTraining totals\n" + tabulate(totals, headers=["", "bytes"], tablefmt="simple"))


def _line_of(mode: ModeReport, step: int) -> str:
    """The program's line that ran op ``step`` (graphmem run), or ""."""
    ops = mode.trace.ops
    return ops[step].line if 0 <= step < len(ops) else ""


def unseen_line(modes: Sequence[ModeReport]) -> str:
    """The headline's warning when a peak is an upper bound because sizes depend on input
    values graphmem invented (nobody gave them): a line under the peaks, or nothing."""
    names = sorted({name for m in modes for name in m.trace.unseen_inputs})
    if not names:
        return ""
    return (f"\nupper bound: sizes depend on values of {', '.join(names)} that graphmem did not see; "
            f"give them with {spelling('sample')} FILE")
