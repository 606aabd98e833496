"""The pre-flight commands: check, max-batch / max-seq, plan (docs/preflight.md).  Exit codes:
0 fits, 1 does not fit, 2 usage errors, 3 analysis failures (a bug too: 1 must only mean "does
not fit"), 130 interrupted, 141 stdout closed (docs/exit-codes.md)."""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from graphmem.cli.exit_codes import DOES_NOT_FIT, SUCCESS
from graphmem.cli.group import main
from graphmem.cli.options import GraphmemCommand, job_options, output_options
from graphmem.cli.shared import (
    PREFLIGHT_MODES,
    analysis,
    budget_options,
    distinct,
    job_of,
    lazy_commands,
    output_kind,
    write,
)
from graphmem.cuda.gpus import get_gpu
from graphmem.errors import UserInputError
from graphmem.job.option import spelling
from graphmem.preflight.budget import METRICS, BudgetAmount, resolve_budget

if TYPE_CHECKING:
    from graphmem.job.job import Job
    from graphmem.preflight.plan import make_plan
    from graphmem.preflight.search import search_largest
    from graphmem.preflight.verdict import check
    from graphmem.report.files import StagedFiles
    from graphmem.report.header import settings_of
    from graphmem.report.plan_table import PLAN_RENDERERS
    from graphmem.report.policy_curve import write_policy_curve
    from graphmem.report.policy_file import render_policy_module
    from graphmem.report.preflight_text import CHECK_RENDERERS, SEARCH_RENDERERS, Context

__all__ = ["check_command", "max_batch_command", "plan_command"]

# imported once a command has a job to do (graphmem.cli.commands says why)
_ANALYSIS = {
    "graphmem.preflight.search": ("search_largest",),
    "graphmem.preflight.plan": ("make_plan",),
    "graphmem.preflight.verdict": ("check",),
    "graphmem.report.header": ("settings_of",),
    "graphmem.report.plan_table": ("PLAN_RENDERERS",),
    "graphmem.report.policy_curve": ("write_policy_curve",),
    "graphmem.report.policy_file": ("render_policy_module",),
    "graphmem.report.preflight_text": ("CHECK_RENDERERS", "SEARCH_RENDERERS", "Context"),
}
__getattr__, _load = lazy_commands(globals(), _ANALYSIS)


def _job(options: Mapping[str, Any]) -> Job:
    return job_of(options, _load)


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
@budget_options
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
    with analysis(debug):
        job, limit, context = _preflight(options, budget, margin)
        if metric is not None and job.device != "cuda":
            raise UserInputError(f"--metric {metric} names one of a GPU's numbers, but the target is {job.device}, "
                                 f"whose one number is the peak; add {spelling('gpu')} NAME (or {spelling('device')} "
                                 "cuda), or drop --metric")
        result = check(job, limit, metric or "reserved")
        text = CHECK_RENDERERS[fmt](result, context, units)
    write(text, output, debug)
    click.get_current_context().exit(SUCCESS if result.fits else DOES_NOT_FIT)


@main.command("max-batch", cls=GraphmemCommand)
@job_options(PREFLIGHT_MODES, "train")
@output_options(["table", "json"])
@budget_options
def max_batch_command(budget: BudgetAmount | None, margin: Fraction, fmt: str, units: str, output: str | None,
                      debug: bool, **options: Any) -> None:
    """The largest batch (max-batch) or sequence length (max-seq) that fits: the dimension written
    as a capital letter in --input (Bx1000, 1xSx64).  N fits and N+1 does not, both analysed.
    Exit 0 when some value fits, 1 when even 1 does not.

    Example: graphmem max-batch examples/mlp.py:MLP --input Bx1000 --budget 64MiB
    """
    key = "max_seq" if click.get_current_context().info_name == "max-seq" else "max_batch"
    with analysis(debug):
        job, limit, context = _preflight(options, budget, margin)
        result = search_largest(job, limit)
        text = SEARCH_RENDERERS[fmt](result, context, units, key=key)
    write(text, output, debug)
    click.get_current_context().exit(SUCCESS if result.max_value else DOES_NOT_FIT)


main.add_command(max_batch_command, name="max-seq")


@main.command("plan", cls=GraphmemCommand)
@job_options(PREFLIGHT_MODES, "train")
@output_options(["table", "json"])
@budget_options
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
@click.option("--emit-policy", "emit_policy", default=None, metavar="FILE.py", callback=output_kind("policy"),
              help="With --policy: write the chosen policy as a Python module (apply_policy(model), torchtitan's "
                   "settings, transformers' own checkpointing calls). Implies --policy.")
@click.option("--policy-curve", "policy_curve", default=None, metavar="FILE.svg|png",
              callback=output_kind("policy_curve"),
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
    distinct(output=output, emit_policy=emit_policy, policy_curve=policy_curve)
    save = tuple(n.strip() for n in policy_save.split(",") if n.strip())
    policy = policy or emit_policy is not None or policy_curve is not None or bool(save)
    with analysis(debug):
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

    write(text, output, debug, files)
