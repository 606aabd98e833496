"""The commands analyze and run (the pre-flight ones are graphmem.cli.preflight_commands).

Each parses its options into one Job (graphmem.cli.options), calls the library once, renders
with the renderer its ``--format`` names, writes the output and maps errors to exit codes
(graphmem.cli.exit_codes; every command runs under graphmem.cli.process: interrupts, stdout,
the JSON error document).  Every output path is validated while the options are parsed, before
the analysis; the files are written whole and renamed into place together (all or none).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

import graphmem.cli.preflight_commands  # noqa: F401  (registers check, max-batch / max-seq and plan)
from graphmem.cli.arguments import program_arguments_apart
from graphmem.cli.exit_codes import DOES_NOT_FIT, SUCCESS
from graphmem.cli.group import main
from graphmem.cli.options import GraphmemCommand, job_options, output_options, section_options
from graphmem.cli.shared import (
    PREFLIGHT_MODES,
    analysis,
    budget_options,
    distinct,
    job_of,
    lazy_commands,
    picture,
    write,
)
from graphmem.cuda.gpus import get_gpu
from graphmem.errors import TraceError, UserInputError
from graphmem.job.choices import ANALYSIS_MODES
from graphmem.job.grammar import input_symbol, parse_sweep
from graphmem.job.option import flag, fold, spelling
from graphmem.job.sections import CudaTarget, Target
from graphmem.preflight.budget import BudgetAmount, resolve_budget
from graphmem.report.formats import COLLAPSE_CHOICES, RENDERER_NAMES

if TYPE_CHECKING:
    from graphmem.api import analyze, program_allocator_again, run_program
    from graphmem.job.job import Job
    from graphmem.job.program import make_program
    from graphmem.preflight.search import sweep
    from graphmem.preflight.verdict import judge
    from graphmem.report import RENDERERS, write_files
    from graphmem.report.files import StagedFiles
    from graphmem.report.header import program_settings, settings_of
    from graphmem.report.html import render_html
    from graphmem.report.preflight_text import SWEEP_RENDERERS, Context, check_to_dict, render_verdict

__all__ = ["PREFLIGHT_MODES", "main"]

# The analysis, and torch with it, is imported once a command has a job to do (``_load``), not
# while the command line is parsed: --help and usage errors never import it.  ``_load`` binds
# these names here (keeping any already bound, e.g. by a test); ``__getattr__`` serves them to
# other modules.
_ANALYSIS = {
    "graphmem.api": ("analyze", "program_allocator_again", "run_program"),
    "graphmem.job.program": ("make_program",),
    "graphmem.preflight.search": ("sweep",),
    "graphmem.preflight.verdict": ("judge",),
    "graphmem.report": ("RENDERERS", "write_files"),
    "graphmem.report.header": ("program_settings", "settings_of"),
    "graphmem.report.html": ("render_html",),
    "graphmem.report.preflight_text": ("SWEEP_RENDERERS", "Context", "check_to_dict", "render_verdict"),
}
__getattr__, _load = lazy_commands(globals(), _ANALYSIS)


def _job(options: Mapping[str, Any]) -> Job:
    return job_of(options, _load)


@main.command("analyze", cls=GraphmemCommand)
@job_options(ANALYSIS_MODES, "both")
@output_options(list(RENDERER_NAMES))
@click.option("--depth", type=click.IntRange(min=1), default=2, show_default=True,
              help="Levels of the module tree in the per-module table, the JSON and the --dot module graph.")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True,
              help="How many of the largest tensors live at the peak to list.")
@click.option("--timeline", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: picture(p, v),
              help="Also draw live bytes over the step, stacked by category, to FILE.svg|.png|.html "
                   "(needs matplotlib: pip install 'graphmem[viz]').")
@click.option("--snapshot", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: picture(p, v),
              help="Also write the predicted allocations as a PyTorch memory snapshot FILE.pickle, "
                   "for pytorch.org/memory_viz or python -m torch.cuda._memory_viz.")
@click.option("--dot", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: picture(p, v),
              help="Also write the op graph as DOT (FILE.dot) or render it with Graphviz (FILE.svg|.png|.pdf); "
                   "needs pydot: pip install 'graphmem[viz]'.")
@click.option("--collapse", type=click.Choice(COLLAPSE_CHOICES), default="auto", show_default=True,
              help="--dot graph: one node per op, per module (cut at --depth), or auto (modules past 300 nodes).")
@click.option("--html", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: picture(p, v),
              help="Also write one self-contained page FILE.html (opens offline in any browser): the facts, "
                   "the memory timelines, the categories at the peak, the per-module table and, with "
                   f"{spelling('parallel')}, the per-GPU table.")
@click.option("--sweep", "sweep_text", metavar="LETTER=LO..HI", default=None,
              help=f"Peak memory against the dimension written as LETTER in {spelling('inputs')} (Bx1000, "
                   "input_ids=1xS:int64): "
                   "B=1..64 (every value up to 32 of them, else 32 spread on a log scale) or B=1,8,32; one "
                   f"recording covers every value its size decisions hold for. With {spelling('gpu')}, the GPU's "
                   "memory "
                   "is the budget line.")
def analyze_command(fmt: str, units: str, output: str | None, debug: bool, depth: int, top: int,
                    timeline: str | None, snapshot: str | None, dot: str | None, collapse: str,
                    html: str | None, sweep_text: str | None, **options: Any) -> None:
    """Analyse TARGET (pkg.module:Attr or path/file.py:Attr): peaks of inference and training.

    Example: graphmem analyze examples/mlp.py:MLP --input 32x1000
    """
    distinct(output=output, timeline=timeline, snapshot=snapshot, dot=dot, html=html)
    if sweep_text is not None:
        drawn = {"--timeline": timeline, "--snapshot": snapshot, "--dot": dot, "--html": html}
        _sweep_command(sweep_text, fmt, units, output, debug, [name for name, path in drawn.items() if path],
                       options)
        return
    with analysis(debug):
        job = _job(options)
        report = analyze(job)
        text = RENDERERS[fmt](report, units, depth=depth, top=top, setup=settings_of(job))

    def files(staged: StagedFiles) -> None:
        write_files(report, timeline=timeline, snapshot=snapshot, dot=dot, collapse=collapse, depth=depth,
                    units=units, staged=staged)
        if html is not None:
            Path(staged.path_for(html)).write_text(render_html(report, units, depth=depth), encoding="utf-8")

    write(text, output, debug, files)


class _RunCommand(GraphmemCommand):
    """``graphmem run``: the module's arguments after ``-m MODULE`` are the module's, as with python."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, program_arguments_apart(args))


@main.command("run", cls=_RunCommand,
              context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-m", "module", metavar="MODULE", default=None,
              help="Run a module as `python -m MODULE ARGS` does (PROGRAM is then its first argument).")
@click.option("--steps", type=click.IntRange(min=1), default=2, show_default=True,
              help="Optimizer steps to record; the program is stopped after the last (its finally blocks run).")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Processes on the node, as torchrun --nproc-per-node starts them (1 included): each sees "
                   "torchrun's RANK, LOCAL_RANK, WORLD_SIZE; init_process_group (any backend) joins a process "
                   "group of that many ranks in which collectives move nothing. Memory per process. "
                   "Default: one process, started as python starts it.")
@click.option("--nnodes", type=click.IntRange(min=1), default=None,
              help="Nodes, as torchrun --nnodes: RANK runs over all of them, LOCAL_RANK and GROUP_RANK per node.")
@click.option("--ranks", default="auto", show_default=True, metavar="auto|all|R,R,...",
              help="With --nproc-per-node: the ranks to record (auto: rank 0, the last, and the first rank "
                   "of each pipeline stage).")
@section_options(Target)
@click.option("--allow-network", is_flag=True, default=False,
              help="Let the program connect to servers (default: its connections are refused).")
@click.option("--write-through", "write_through", multiple=True, metavar="PATH",
              help="Let the program write PATH (a file or a folder) for real, e.g. a metrics file it logs to; "
                   "repeatable. Every other write goes to a layer of its own, dropped after the run: your "
                   "files are never changed.")
@output_options(list(RENDERER_NAMES))
@click.option("--depth", type=click.IntRange(min=1), default=2, show_default=True,
              help="Levels of the module tree in the per-module table and the JSON.")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True,
              help="How many of the largest tensors live at the peak to list.")
@click.option("--timeline", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: picture(p, v),
              help="Also draw live bytes over the run, stacked by category, to FILE.svg|.png|.html "
                   "(needs matplotlib: pip install 'graphmem[viz]').")
@click.option("--snapshot", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: picture(p, v),
              help="Also write the predicted allocations as a PyTorch memory snapshot FILE.pickle.")
@click.option("--html", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: picture(p, v),
              help="Also write one self-contained page FILE.html.")
@budget_options
@click.argument("program", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run_command(module: str | None, steps: int, device: str | None, nproc_per_node: int | None, nnodes: int | None,
                ranks: str,
                gpu: str | None, sdpa: str,
                alloc_conf: str | None, allow_network: bool, write_through: tuple[str, ...],
                budget: BudgetAmount | None, margin: Fraction, fmt: str,
                units: str,
                output: str | None,
                debug: bool, depth: int, top: int, timeline: str | None, snapshot: str | None, html: str | None,
                program: str | None, args: tuple[str, ...]) -> None:
    """Run a training program, unchanged, and predict its memory: graphmem run [OPTIONS] SCRIPT.py [ARGS]...

    Everything after SCRIPT.py (or -m MODULE) is the program's own argv, as with python. The
    program runs from its first line with every tensor it makes a fake one (no memory, no
    weights), up to the end of its --steps-th optimizer step; the report covers the whole run:
    model building, data, the steps and whatever the program keeps between them.

    With --budget: will it fit?  Exit 0 when the run's peak with --margin fits (on a GPU: the
    caching allocator's reserved peak plus the CUDA context), 1 when it does not, as graphmem
    check; 3 when the program fails or stops before its first optimizer step.

    Example: graphmem run examples/train_loop.py --batch-size 32
    """
    distinct(output=output, timeline=timeline, snapshot=snapshot, html=html)
    if module is None and program is None:
        raise click.UsageError("give the program to run: graphmem run SCRIPT.py [ARGS]... "
                               "or graphmem run -m MODULE [ARGS]...")
    target, argv = (module, (*([program] if program else []), *args)) if module else (program, args)
    assert target is not None
    with analysis(debug):
        if device == "cpu" and gpu is not None:
            raise UserInputError(f"{flag(CudaTarget, 'gpu')} {gpu} is a GPU and {flag(Target, 'device')} cpu the "
                                 "CPU: give one of them")
        where = fold(Target, {"device": device, "gpu": gpu, "sdpa": sdpa, "alloc_conf": alloc_conf})
        limit = resolve_budget(budget, get_gpu(where.gpu) if where.gpu else None, margin) \
            if budget is not None else None
        _load()
        chosen = make_program(target, tuple(argv), module=module is not None, steps=steps,
                              nproc_per_node=nproc_per_node, nnodes=nnodes, allow_network=allow_network,
                              write_through=write_through, ranks=ranks, runs_on=where, own_options=_own_options())
        report = run_program(chosen)
        train = report.train
        setup = program_settings(train.optimizer or "none" if train else "none", where)
        text = RENDERERS[fmt](report, units, depth=depth, top=top, setup=setup)
        # a program that failed gets no verdict; the allocator's what-if reuses the recording (the program runs once)
        verdict = judge(report, "train", limit, lambda conf: program_allocator_again(report, conf), alloc_conf) \
            if limit is not None and report.program_failed is None else None
        if verdict is not None:
            context = Context(target=chosen.command, inputs=(), device=report.device, mode="train",
                              gpu=report.gpu.name if report.gpu else None)
            hint = "the report above shows where the peak is and what is live there"
            text = (f"{text.rstrip()}\n\nWill it fit?\n{render_verdict(verdict, context, units, hint)}" if fmt != "json"
                    else json.dumps({**json.loads(text), "check": check_to_dict(verdict, context)}, indent=2))

    def files(staged: StagedFiles) -> None:
        write_files(report, timeline=timeline, snapshot=snapshot, dot=None, collapse="auto", depth=depth,
                    units=units, staged=staged)
        if html is not None:
            Path(staged.path_for(html)).write_text(render_html(report, units, depth=depth), encoding="utf-8")

    write(text, output, debug, files)
    if report.program_failed is not None:  # what was recorded is shown; the run did not succeed
        with analysis(debug):
            raise TraceError(report.program_failed)
    if verdict is not None:
        click.get_current_context().exit(SUCCESS if verdict.fits else DOES_NOT_FIT)


def _own_options() -> frozenset[str]:
    """The current command's option names (``--steps``, ``-o``...; not ``-m``, which programs use
    too): a program given one of them is told they go before the script."""
    command = click.get_current_context().command
    return frozenset(name for param in command.params if isinstance(param, click.Option)
                     for name in (*param.opts, *param.secondary_opts)) - {"-m"}


def _sweep_command(text: str, fmt: str, units: str, output: str | None, debug: bool, files: list[str],
                   options: dict[str, Any]) -> None:
    """``analyze --sweep``: the peaks at each value (graphmem.preflight.search.sweep)."""
    with analysis(debug):
        if files:
            raise UserInputError(f"{', '.join(files)} draw one analysis; --sweep makes one per value: drop one "
                                 "or the other")
        letter, values = parse_sweep(text)
        job = _job(options)
        if fmt not in SWEEP_RENDERERS:  # a --format of analyze's that sweeps do not print
            raise UserInputError(f"--sweep prints a table or JSON; got --format {fmt}")
        inputs = job.with_preset().inputs.specs
        symbol = input_symbol(inputs)
        if symbol != letter:
            where = f"the inputs use {symbol}" if symbol else "no input has a capital-letter dimension"
            raise UserInputError(f"--sweep {text} sweeps {letter}, but {where}; write it in {spelling('inputs')}, "
                                 "e.g. "
                                 f"{spelling('inputs')} {letter}x1000")
        gpu = get_gpu(options["gpu"]) if options["gpu"] else None
        result = sweep(job, values, resolve_budget(None, gpu) if gpu else None)
        context = Context(target=job.target_name, inputs=inputs, device=job.device,
                          mode=job.mode, gpu=gpu.name if gpu else None, setup=settings_of(job))
        rendered = SWEEP_RENDERERS[fmt](result, context, units)
    write(rendered, output, debug)
