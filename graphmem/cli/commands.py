"""The commands: analyze, check, max-batch / max-seq, plan.

Each parses its options into one Job (graphmem.cli.options), calls the library once, renders
with the renderer its ``--format`` names, writes the output and maps errors to exit codes
(graphmem.cli.exit_codes; every command runs under graphmem.cli.process: interrupts, stdout,
the JSON error document).  Every output path is validated while the options are parsed, before
the analysis; the files are written whole and renamed into place together (all or none).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from graphmem._lazy import lazy_exports
from graphmem.cli.arguments import program_arguments_apart
from graphmem.cli.exit_codes import DOES_NOT_FIT, SUCCESS, errors_to_exit_codes
from graphmem.cli.group import main
from graphmem.cli.options import GraphmemCommand, ParsedType, job_from, job_options, output_options, section_options
from graphmem.cli.process import print_result, raise_if_interrupted, user_output_to_stderr
from graphmem.cuda.gpus import get_gpu
from graphmem.errors import TraceError, UserInputError
from graphmem.job.choices import ANALYSIS_MODES
from graphmem.job.grammar import input_symbol, parse_sweep
from graphmem.job.option import flag, fold, spelling
from graphmem.job.sections import CudaTarget, Target
from graphmem.preflight.budget import METRICS, BudgetAmount, parse_budget, parse_margin, resolve_budget
from graphmem.report.formats import COLLAPSE_CHOICES, RENDERER_NAMES
from graphmem.report.paths import check_html_path, check_output_path

if TYPE_CHECKING:
    from graphmem.api import analyze, program_allocator_again, run_program
    from graphmem.job.job import Job
    from graphmem.job.program import make_program
    from graphmem.preflight.plan import make_plan
    from graphmem.preflight.search import search_largest, sweep
    from graphmem.preflight.verdict import check, judge
    from graphmem.report import RENDERERS, write_files
    from graphmem.report.files import StagedFiles, staged_files
    from graphmem.report.header import program_settings, settings_of
    from graphmem.report.html import render_html
    from graphmem.report.plan_table import PLAN_RENDERERS
    from graphmem.report.policy_curve import write_policy_curve
    from graphmem.report.policy_file import render_policy_module
    from graphmem.report.preflight_text import (
        CHECK_RENDERERS,
        SEARCH_RENDERERS,
        SWEEP_RENDERERS,
        Context,
        check_to_dict,
        render_verdict,
    )

__all__ = ["main"]

# The analysis, and torch with it, is imported once a command has a job to do (``_load``), not
# while the command line is parsed: --help and usage errors never import it.  ``_load`` binds
# these names here (keeping any already bound, e.g. by a test); ``__getattr__`` serves them to
# other modules.
_ANALYSIS = {
    "graphmem.api": ("analyze", "program_allocator_again", "run_program"),
    "graphmem.job.program": ("make_program",),
    "graphmem.preflight.search": ("search_largest", "sweep"),
    "graphmem.preflight.plan": ("make_plan",),
    "graphmem.preflight.verdict": ("check", "judge"),
    "graphmem.report": ("RENDERERS", "write_files"),
    "graphmem.report.files": ("staged_files",),
    "graphmem.report.header": ("program_settings", "settings_of"),
    "graphmem.report.html": ("render_html",),
    "graphmem.report.plan_table": ("PLAN_RENDERERS",),
    "graphmem.report.policy_curve": ("write_policy_curve",),
    "graphmem.report.policy_file": ("render_policy_module",),
    "graphmem.report.preflight_text": ("CHECK_RENDERERS", "SEARCH_RENDERERS", "SWEEP_RENDERERS", "Context",
                                       "check_to_dict", "render_verdict"),
}
__getattr__ = lazy_exports(globals(), _ANALYSIS)
# the pre-flight commands analyse these modes (graphmem.preflight.search.PREFLIGHT_MODES; a test keeps them equal)
PREFLIGHT_MODES = ("train", "inference")


def _load() -> None:
    """Import the analysis into this module (see ``_ANALYSIS``)."""
    for names in _ANALYSIS.values():
        for name in names:
            if name not in globals():
                __getattr__(name)


def _job(options: Mapping[str, Any]) -> Job:
    """The Job the options describe (``job_from``: a job they leave undescribed is refused before
    anything heavy is imported), with the analysis loaded."""
    job = job_from(options)
    _load()
    return job


def _output_kind(kind: str) -> Callable[[Any, Any, str | None], str | None]:
    """A click callback refusing a path where no ``kind`` file (graphmem.report.paths) can be written."""
    def check(_: Any, param: Any, path: str | None) -> str | None:
        try:
            return None if path is None else check_output_path(kind, path)
        except UserInputError as exc:
            raise click.BadParameter(str(exc), param=param) from None
    return check


def _picture(param: Any, path: str | None) -> str | None:
    """Refuse a picture (or --html page) path with the wrong suffix, in a folder where no file
    can be written, or whose extra is missing, before analysing."""
    try:
        if path is None:
            return None
        return check_html_path(path) if param.name == "html" else check_output_path(param.name, path)
    except UserInputError as exc:
        raise click.BadParameter(str(exc), param=param) from None


@contextlib.contextmanager
def _analysis(debug: bool) -> Iterator[None]:
    """Around the library call: the user's code prints to stderr, errors leave with their exit codes."""
    with errors_to_exit_codes(debug), user_output_to_stderr():
        yield


def _write(text: str, output: str | None, debug: bool, pictures: Callable[[StagedFiles], None] | None = None) -> None:
    """The result to --output (with the pictures: each written whole under a temporary name,
    all renamed into place once all are written, none left on failure) or to stdout.  Nothing
    is written once interrupted.  ``--output /dev/stdout`` is stdout: the command's own fd 1 is
    stderr (graphmem.cli.supervisor prints the result)."""
    if output is not None and os.path.abspath(output) in ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"):
        output = None
    with errors_to_exit_codes(debug), staged_files() as staged:
        if pictures is not None:
            pictures(staged)
        if output:
            Path(staged.path_for(output)).write_text(text, encoding="utf-8")
        raise_if_interrupted()
    if not output:
        print_result(text)


def _distinct(**paths: str | None) -> None:
    """Refuse two outputs of one run that name the same file (one would overwrite the other): the
    same path after symbolic links, or two hard links of one file.  A device or FIFO may take two."""
    seen: dict[object, str] = {}
    for option, path in paths.items():
        if path is None:
            continue
        try:
            found = os.stat(path)
        except OSError:  # a new file: its path, links resolved, is its identity
            key: object = os.path.realpath(path)
        else:
            if not stat.S_ISREG(found.st_mode):
                continue
            key = (found.st_dev, found.st_ino)
        if key in seen:
            raise click.UsageError(f"--{seen[key]} and --{option} name the same file {path!r}; give each its own")
        seen[key] = option


@main.command("analyze", cls=GraphmemCommand)
@job_options(ANALYSIS_MODES, "both")
@output_options(list(RENDERER_NAMES))
@click.option("--depth", type=click.IntRange(min=1), default=2, show_default=True,
              help="Levels of the module tree in the per-module table, the JSON and the --dot module graph.")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True,
              help="How many of the largest tensors live at the peak to list.")
@click.option("--timeline", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: _picture(p, v),
              help="Also draw live bytes over the step, stacked by category, to FILE.svg|.png|.html "
                   "(needs matplotlib: pip install 'graphmem[viz]').")
@click.option("--snapshot", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: _picture(p, v),
              help="Also write the predicted allocations as a PyTorch memory snapshot FILE.pickle, "
                   "for pytorch.org/memory_viz or python -m torch.cuda._memory_viz.")
@click.option("--dot", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: _picture(p, v),
              help="Also write the op graph as DOT (FILE.dot) or render it with Graphviz (FILE.svg|.png|.pdf); "
                   "needs pydot: pip install 'graphmem[viz]'.")
@click.option("--collapse", type=click.Choice(COLLAPSE_CHOICES), default="auto", show_default=True,
              help="--dot graph: one node per op, per module (cut at --depth), or auto (modules past 300 nodes).")
@click.option("--html", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: _picture(p, v),
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
    _distinct(output=output, timeline=timeline, snapshot=snapshot, dot=dot, html=html)
    if sweep_text is not None:
        drawn = {"--timeline": timeline, "--snapshot": snapshot, "--dot": dot, "--html": html}
        _sweep_command(sweep_text, fmt, units, output, debug, [name for name, path in drawn.items() if path],
                       options)
        return
    with _analysis(debug):
        job = _job(options)
        report = analyze(job)
        text = RENDERERS[fmt](report, units, depth=depth, top=top, setup=settings_of(job))

    def files(staged: StagedFiles) -> None:
        write_files(report, timeline=timeline, snapshot=snapshot, dot=dot, collapse=collapse, depth=depth,
                    units=units, staged=staged)
        if html is not None:
            Path(staged.path_for(html)).write_text(render_html(report, units, depth=depth), encoding="utf-8")

    _write(text, output, debug, files)


# 80GiB, 80GB, 512MiB, 123456B, or 0.9 / 90% of --gpu -> BudgetAmount
BudgetType = lambda: ParsedType("BYTES|FRACTION", parse_budget, BudgetAmount)
# 5% or 0.05 -> Fraction
MarginType = lambda: ParsedType("PERCENT", parse_margin, Fraction)


def _budget_options(command: Any) -> Any:
    """Add --budget and --margin to a pre-flight command."""
    command = click.option("--margin", type=MarginType(), default="0%", show_default=True,
                           help="Keep this share free: fits when peak x (1 + margin) <= budget.")(command)
    return click.option("--budget", type=BudgetType(), default=None,
                        help="Memory available: 123456B, 512MiB, 80GiB, 80GB (decimal), or 0.9 / 90% of "
                             f"{spelling('gpu')}. "
                             f"Default: all of {spelling('gpu')}'s memory.")(command)


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
@click.option("--timeline", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: _picture(p, v),
              help="Also draw live bytes over the run, stacked by category, to FILE.svg|.png|.html "
                   "(needs matplotlib: pip install 'graphmem[viz]').")
@click.option("--snapshot", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: _picture(p, v),
              help="Also write the predicted allocations as a PyTorch memory snapshot FILE.pickle.")
@click.option("--html", type=click.Path(dir_okay=False), default=None, callback=lambda c, p, v: _picture(p, v),
              help="Also write one self-contained page FILE.html.")
@_budget_options
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
    _distinct(output=output, timeline=timeline, snapshot=snapshot, html=html)
    if module is None and program is None:
        raise click.UsageError("give the program to run: graphmem run SCRIPT.py [ARGS]... "
                               "or graphmem run -m MODULE [ARGS]...")
    target, argv = (module, (*([program] if program else []), *args)) if module else (program, args)
    assert target is not None
    with _analysis(debug):
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

    _write(text, output, debug, files)
    if report.program_failed is not None:  # what was recorded is shown; the run did not succeed
        with _analysis(debug):
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
    with _analysis(debug):
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
    _write(rendered, output, debug)


# ---------------------------------------------------------------------------------------------
# Pre-flight: check, max-batch / max-seq, plan (docs/preflight.md).  Exit codes: 0 fits,
# 1 does not fit, 2 usage errors, 3 analysis failures (a bug too: 1 must only mean "does not fit"),
# 130 interrupted, 141 stdout closed (docs/exit-codes.md).

def _preflight(options: dict[str, Any], budget: BudgetAmount | None, margin: Fraction) -> tuple[Job, Any, Context]:
    """The Job, the budget and the header's context, from a pre-flight command's options."""
    job = _job(options)
    gpu = get_gpu(options["gpu"]) if options["gpu"] else None
    shown = job.with_preset()
    mode = f"generation {job.generate.prompt}+{job.generate.new} x {job.generate.batch}" if job.generate else job.mode
    context = Context(target=job.target_name, inputs=shown.inputs.specs, device=job.device, mode=mode,
                      gpu=gpu.name if gpu else None, setup=settings_of(job))
    return job, resolve_budget(budget, gpu, margin), context


@main.command("check", cls=GraphmemCommand)
@job_options(PREFLIGHT_MODES, "train")
@output_options(["table", "json"])
@_budget_options
@click.option("--metric", type=click.Choice(METRICS), default=None,
              help="On a GPU, the number compared with the budget: allocated (max_memory_allocated), reserved "
                   "(max_memory_reserved; the default) or nvidia-smi (the nvidia-smi estimate); the budget also "
                   "holds what lives outside PyTorch's allocator (CUDA context, NCCL buffers).")
def check_command(budget: BudgetAmount | None, margin: Fraction, metric: str | None, fmt: str, units: str,
                  output: str | None, debug: bool, **options: Any) -> None:
    """Will TARGET fit the budget?  Exit 0: the predicted peak with --margin fits (on a GPU: the
    caching allocator's reserved peak plus the CUDA context and NCCL buffers); 1: it does not;
    2: usage error; 3: the analysis failed; 130: interrupted.

    On a GPU, --metric allocated or nvidia-smi compares another of its numbers instead.

    Example: graphmem check examples/mlp.py:MLP --input 32x1000 --budget 16MiB --margin 5%
    """
    with _analysis(debug):
        job, limit, context = _preflight(options, budget, margin)
        if metric is not None and job.device != "cuda":
            raise UserInputError(f"--metric {metric} names one of a GPU's numbers, but the target is {job.device}, "
                                 f"whose one number is the peak; add {spelling('gpu')} NAME (or {spelling('device')} "
                                 "cuda), or drop --metric")
        result = check(job, limit, metric or "reserved")
        text = CHECK_RENDERERS[fmt](result, context, units)
    _write(text, output, debug)
    click.get_current_context().exit(SUCCESS if result.fits else DOES_NOT_FIT)


@main.command("max-batch", cls=GraphmemCommand)
@job_options(PREFLIGHT_MODES, "train")
@output_options(["table", "json"])
@_budget_options
def max_batch_command(budget: BudgetAmount | None, margin: Fraction, fmt: str, units: str, output: str | None,
                      debug: bool, **options: Any) -> None:
    """The largest batch (max-batch) or sequence length (max-seq) that fits: the dimension written
    as a capital letter in --input (Bx1000, 1xSx64).  N fits and N+1 does not, both analysed.
    Exit 0 when some value fits, 1 when even 1 does not.

    Example: graphmem max-batch examples/mlp.py:MLP --input Bx1000 --budget 64MiB
    """
    key = "max_seq" if click.get_current_context().info_name == "max-seq" else "max_batch"
    with _analysis(debug):
        job, limit, context = _preflight(options, budget, margin)
        result = search_largest(job, limit)
        text = SEARCH_RENDERERS[fmt](result, context, units, key=key)
    _write(text, output, debug)
    click.get_current_context().exit(SUCCESS if result.max_value else DOES_NOT_FIT)


main.add_command(max_batch_command, name="max-seq")


@main.command("plan", cls=GraphmemCommand)
@job_options(PREFLIGHT_MODES, "train")
@output_options(["table", "json"])
@_budget_options
@click.option("--world-size", type=click.IntRange(min=1), default=None,
              help="GPUs you could use: adds ZeRO-1 and FSDP2 rows sharding over up to N of them (analysed). "
                   f"Default: the job's own (one GPU, or the GPUs of {spelling('parallel')}).")
@click.option("--prune-amount", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.5,
              show_default=True, help="Share of each Linear/Conv weight the pruning rows remove.")
@click.option("--group-size", type=click.IntRange(min=1), default=128, show_default=True,
              help="int4 quantization group size (formula rows).")
@click.option("--policy", "policy", is_flag=True,
              help="Choose which blocks to checkpoint: the least recompute whose peak fits the budget, solved "
                   "over every choice and verified by analysis, with the memory/recompute front (instead of "
                   f"the table of remedies; training, on one device or under {spelling('parallel')} fsdp=N, where it "
                   "also "
                   "chooses FSDP2's reshard_after_forward, and finer units where they help).")
@click.option("--emit-policy", "emit_policy", default=None, metavar="FILE.py", callback=_output_kind("policy"),
              help="With --policy: write the chosen policy as a Python module (apply_policy(model), torchtitan's "
                   "settings, transformers' own checkpointing calls). Implies --policy.")
@click.option("--policy-curve", "policy_curve", default=None, metavar="FILE.svg|png",
              callback=_output_kind("policy_curve"),
              help="With --policy: draw the front, peak against recompute, with the budget line. Implies --policy.")
@click.option("--front-points", type=click.IntRange(min=2), default=8, show_default=True,
              help="With --policy: points of the front analysed (each an analysis of the whole step).")
@click.option("--policy-save", default="", metavar="OPS",
              help="With --policy: choose per block among kept, checkpointed whole, and checkpointed keeping the "
                   "outputs of these ops (selective: matmuls, attention or aten op names, comma-separated, e.g. "
                   "matmuls,attention) and recomputing the rest; the emitted module keeps them in its SELECTIVE "
                   "blocks. Implies --policy.")
@click.option("--policy-ops/--no-policy-ops", "policy_ops", default=True, show_default=True,
              help="With --policy: after choosing the blocks, keep the outputs of single ops inside them (a "
                   "submodule's matmuls, the attention) where the budget leaves room, and under "
                   f"{spelling('parallel')} "
                   "fsdp=N the last units' parameters, each step analysed; --no-policy-ops: neither, whole "
                   "blocks and one setting for every unit only.")
def plan_command(budget: BudgetAmount | None, margin: Fraction, fmt: str, units: str, output: str | None,
                 debug: bool, world_size: int | None, prune_amount: float, group_size: int, policy: bool,
                 emit_policy: str | None, policy_curve: str | None, front_points: int, policy_save: str,
                 policy_ops: bool, **options: Any) -> None:
    """What to change so TARGET fits: each remedy (batch, checkpointing, autocast, optimizer,
    accumulation, ZeRO/FSDP, offload, quantization, pruning) alone and combined, ranked, with its
    predicted peak, saving and extra compute; and why training takes N times inference.  With
    --policy: which blocks to checkpoint for the least recompute that fits (with --policy-save OPS,
    also which of them keep those ops' outputs).

    Example: graphmem plan examples/gpt.py:GPT --input 8x256:int64 --loss cross_entropy --budget 64MiB
    """
    _distinct(output=output, emit_policy=emit_policy, policy_curve=policy_curve)
    save = tuple(n.strip() for n in policy_save.split(",") if n.strip())
    policy = policy or emit_policy is not None or policy_curve is not None or bool(save)
    with _analysis(debug):
        job, limit, context = _preflight(options, budget, margin)
        plan = make_plan(job, limit, world_size=world_size, prune_amount=prune_amount, group_size=group_size,
                         policy=policy, front_points=front_points, policy_save=save, policy_ops=policy_ops)
        text = PLAN_RENDERERS[fmt](plan, context, units)

    def files(staged: StagedFiles) -> None:
        if plan.policy is not None and emit_policy is not None:
            described = " ".join([context.target, *(f"{spelling('inputs')} {i}" for i in context.inputs)])
            Path(staged.path_for(emit_policy)).write_text(render_policy_module(plan.policy, described),
                                                          encoding="utf-8")
        if plan.policy is not None and policy_curve is not None:
            write_policy_curve(plan.policy, staged.path_for(policy_curve), context.target, units)

    _write(text, output, debug, files)
