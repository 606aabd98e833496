"""Stage 5: the command line.  The only module that imports click.

Turns strings into specs, calls ``graphmem.analyze`` once, renders with the renderer the
``--format`` name picks, writes the output, and maps errors to exit codes:
0 success; 2 usage errors (bad TARGET, --input, option); 3 analysis failures; 1 a bug.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import click

from graphmem import __version__
from graphmem.api import ANALYSIS_MODES, DEVICES, analyze
from graphmem.budget import BudgetAmount, parse_budget, parse_margin, resolve_budget
from graphmem.cuda import SDPA_CHOICES
from graphmem.errors import GraphmemError, UserInputError
from graphmem.gpus import GPUS, get_gpu
from graphmem.load import ModelSource, load_hf_config, resolve_target
from graphmem.plan import make_plan
from graphmem.preflight import PREFLIGHT_MODES, Job, check, search_largest, validate_inputs
from graphmem.presets import PRESETS
from graphmem.report import COLLAPSE_CHOICES, RENDERERS, UNIT_CHOICES, check_output_path, write_files
from graphmem.report.plan_table import PLAN_RENDERERS
from graphmem.report.preflight_text import CHECK_RENDERERS, SEARCH_RENDERERS, Context
from graphmem.spec import MODEL_DTYPES, InputSpec, parse_dtype, parse_input_spec
from graphmem.step import AMP_DTYPES, LOSSES, OPTIMIZER_CHOICES, OPTIMIZER_IMPLS
from graphmem.values import parse_assumption

__all__ = ["main"]


class ParsedType(click.ParamType):  # type: ignore[type-arg]  # generic only in click >= 8.2
    """A value parsed by one of graphmem's parsers; its UserInputError becomes a usage error.

    Args:
        name: the metavar shown in --help.
        parse: str -> value, raising UserInputError.
        done: values of this type are already parsed (click may convert defaults twice).
    """

    def __init__(self, name: str, parse: Callable[[str], Any], done: type | tuple[type, ...] = ()) -> None:
        self.name, self.parse, self.done = name, parse, done

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if self.done and isinstance(value, self.done):
            return value
        try:
            return self.parse(value)
        except UserInputError as exc:
            self.fail(str(exc), param, ctx)


def TargetType() -> ParsedType:
    """``pkg.module:Attr`` or ``path/file.py:Attr`` -> (the text, the imported class, factory or module)."""
    return ParsedType("TARGET", lambda text: (text, resolve_target(text)), tuple)


def InputSpecType() -> ParsedType:
    """``[NAME=]DIMS[:DTYPE]`` -> InputSpec."""
    return ParsedType("[NAME=]DIMS[:DTYPE]", parse_input_spec, InputSpec)


class JsonObjectType(click.ParamType):  # type: ignore[type-arg]
    """A JSON object given on the command line, e.g. ``'{"hidden": 256}'``."""

    name = "JSON"

    def convert(self, value: Any, param: Any, ctx: Any) -> dict[str, Any]:
        if isinstance(value, dict):
            return value
        try:
            data = json.loads(value)
        except json.JSONDecodeError as exc:
            self.fail(f"not valid JSON ({exc.msg} at column {exc.colno}): {value!r}; "
                      "expected an object such as '{\"hidden\": 256}'", param, ctx)
        if not isinstance(data, dict):
            self.fail(f"expected a JSON object such as '{{\"hidden\": 256}}', got {value!r}", param, ctx)
        return data


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="graphmem")
def main() -> None:
    """Predict the memory of a PyTorch training step before it runs.

    The model is built on the meta device (no weights are allocated); the real step
    (forward, autograd backward, optimizer) is recorded as a graph of aten ops on fake
    tensors, and a storage-aware liveness pass gives the live bytes after every op.
    """


@main.command()
@click.argument("target", type=TargetType(), required=False)
@click.option("--preset", type=click.Choice(list(PRESETS)), default=None,
              help="A well-known transformers model by its published config (no download); TARGET "
                   "may then be omitted.")
@click.option("--generate", default=None, metavar="PROMPT+NEW",
              help="Inference with a KV cache instead of --mode: the prefill of PROMPT tokens and the "
                   "last of NEW decode steps (causal LMs), e.g. 2048+512. --input is then optional.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --generate: sequences generated at once.")
@click.option("--hf-config", type=click.Path(dir_okay=False), default=None,
              help="A local config.json for a transformers model class TARGET (e.g. transformers:LlamaForCausalLM).")
@click.option("--hf-config-kwargs", type=JsonObjectType(), default=None,
              help="JSON object of config values for a transformers model class (override --hf-config).")
@click.option("--input", "-i", "inputs", type=InputSpecType(), multiple=True,
              help="Example input, repeatable: 32x1000, 8x512:int64, input_ids=2x128:int64. "
                   "Unnamed inputs are positional, named ones keyword arguments. Default dtype float32.")
@click.option("--assume", "assumptions", multiple=True, metavar="NAME=VALUE",
              help="Value of an integer input, used only where the model reads values "
                   "(if mask.all(), nonzero): ones, zeros, arange or an integer. Defaults: *mask* "
                   "inputs ones, position_ids arange, others zeros. Repeatable.")
@click.option("--kwargs", "model_kwargs", type=JsonObjectType(), default=None,
              help="JSON object of keyword arguments for the model class or factory.")
@click.option("--mode", type=click.Choice(ANALYSIS_MODES), default="both", show_default=True,
              help="Analyse inference, a training step, or both.")
@click.option("--optimizer", default="adam", show_default=True, metavar="NAME|pkg.module:Class",
              help="Optimizer of the training step: the real torch.optim class with its defaults "
                   f"({', '.join(OPTIMIZER_CHOICES)}; the *8bit ones are bitsandbytes sized by formula), "
                   "or any importable torch.optim.Optimizer subclass.")
@click.option("--optimizer-kwargs", type=JsonObjectType(), default=None,
              help="JSON object of extra optimizer arguments, e.g. '{\"lr\": 0.01, \"amsgrad\": true}'.")
@click.option("--optimizer-impl", type=click.Choice(list(OPTIMIZER_IMPLS)), default="auto", show_default=True,
              help="auto: what PyTorch picks for the target device (for-loop on CPU).")
@click.option("--amp", type=click.Choice(list(AMP_DTYPES)), default=None,
              help="Mixed precision: torch.autocast around forward and loss; fp16 adds a GradScaler.")
@click.option("--checkpoint", "checkpoint_classes", default="", metavar="CLASS[,CLASS]",
              help="What-if: run every module of these classes under non-reentrant activation "
                   "checkpointing; the report shows the peak with and without it.")
@click.option("--grad-accum", type=click.IntRange(min=1), default=1, show_default=True,
              help="Forward/backward micro-steps per optimizer step.")
@click.option("--loss", type=click.Choice(LOSSES), default="auto", show_default=True,
              help="auto: output.loss if present, else sum of the first float output; "
                   "cross_entropy/nll use int64 class targets.")
@click.option("--dtype", type=click.Choice(MODEL_DTYPES), default=None,
              help="Convert the model's floating parameters and buffers, as model.to(dtype).")
@click.option("--device", type=click.Choice(DEVICES), default="cpu", show_default=True,
              help="Target device whose allocations are predicted. cuda: CUDA's kernel choices and the "
                   "caching allocator (what torch.cuda.max_memory_allocated / _reserved will say).")
@click.option("--gpu", default="h100-80gb", show_default=True, metavar="NAME",
              help=f"With --device cuda: the GPU ({', '.join(GPUS)}).")
@click.option("--sdpa", type=click.Choice(SDPA_CHOICES), default="auto", show_default=True,
              help="With --device cuda: attention backend; auto is PyTorch's own choice for the GPU and dtype.")
@click.option("--alloc-conf", default=None, metavar="TEXT",
              help="With --device cuda: PYTORCH_CUDA_ALLOC_CONF settings "
                   "(default: the environment variable), e.g. expandable_segments:True.")
@click.option("--format", "fmt", type=click.Choice(list(RENDERERS)), default="table", show_default=True,
              help="Output format; json follows docs/json-schema.md.")
@click.option("--units", type=click.Choice(UNIT_CHOICES), default="auto", show_default=True,
              help="Units of sizes in tables (JSON is always in bytes).")
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the report to this file instead of standard output.")
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
@click.option("--debug", is_flag=True, help="Show the full traceback on errors.")
def analyze_command(target: tuple[str, ModelSource] | None, preset: str | None, generate: str | None,
                    batch: int, hf_config: str | None,
                    hf_config_kwargs: dict[str, Any] | None, inputs: tuple[InputSpec, ...],
                    assumptions: tuple[str, ...], model_kwargs: dict[str, Any] | None, mode: str,
                    optimizer: str,
                    optimizer_kwargs: dict[str, Any] | None, optimizer_impl: str, amp: str | None,
                    checkpoint_classes: str, grad_accum: int, loss: str,
                    dtype: str | None, device: str, gpu: str, sdpa: str, alloc_conf: str | None,
                    fmt: str, units: str, output: str | None,
                    depth: int, top: int, timeline: str | None, snapshot: str | None, dot: str | None,
                    collapse: str, debug: bool) -> None:
    """Analyse TARGET (pkg.module:Attr or path/file.py:Attr): peaks of inference and training.

    Example: graphmem analyze examples/mlp.py:MLP --input 32x1000
    """
    name, source = target or (preset or "", None)
    with _errors_to_exit_codes(debug):
        report = analyze(source, inputs, preset=preset, hf_config=load_hf_config(hf_config, hf_config_kwargs),
                         generate=generate, batch=batch,
                         mode=mode, optimizer=optimizer, loss=loss, device=device,
                         dtype=parse_dtype(dtype) if dtype else None, kwargs=model_kwargs,
                         optimizer_kwargs=optimizer_kwargs, optimizer_impl=optimizer_impl, amp=amp,
                         checkpoint=[c.strip() for c in checkpoint_classes.split(",") if c.strip()],
                         grad_accum=grad_accum, gpu=gpu, sdpa=sdpa, alloc_conf=alloc_conf,
                         assume=dict(parse_assumption(a) for a in assumptions))
        text = RENDERERS[fmt](_named(report, name), units, depth=depth, top=top)
        write_files(_named(report, name), timeline=timeline, snapshot=snapshot, dot=dot, collapse=collapse,
                    depth=depth, units=units)
    if output:
        with open(output, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        click.echo(text, nl=False)


analyze_command.name = "analyze"


def _picture(param: Any, path: str | None) -> str | None:
    """Refuse a picture path with the wrong suffix or a missing extra before analysing."""
    try:
        return None if path is None else check_output_path(param.name, path)
    except UserInputError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def _named(report: Any, name: str) -> Any:
    from dataclasses import replace

    return replace(report, target=name)


@contextlib.contextmanager
def _errors_to_exit_codes(debug: bool, bug_exit: int = 1, debug_keeps_code: bool = False) -> Iterator[None]:
    """GraphmemError -> 'Error: ...' with its exit code (2 usage, 3 analysis); a bug -> an
    'internal error' line and ``bug_exit``.  ``--debug`` re-raises (the traceback), or, with
    ``debug_keeps_code``, prints the traceback and keeps the exit code."""
    try:
        yield
    except (click.ClickException, click.exceptions.Exit, KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        if debug and not debug_keeps_code:
            raise
        if debug:
            traceback.print_exception(exc)
        if isinstance(exc, GraphmemError):
            error = click.ClickException(str(exc))
            error.exit_code = exc.exit_code  # type: ignore[misc]
            raise error from None
        click.echo(f"Error: internal error: {type(exc).__name__}: {exc} "
                   "(rerun with --debug for the traceback, and please report it)", err=True)
        sys.exit(bug_exit)


# ---------------------------------------------------------------------------------------------
# Pre-flight: check, max-batch / max-seq, plan (docs/preflight.md).  Exit codes: 0 fits,
# 1 does not fit, 2 usage errors, 3 analysis failures (a bug too: 1 must only mean "does not fit").

# the analyze command's options these commands share, by parameter name
_SHARED_OPTIONS = ("model_kwargs", "assumptions", "optimizer", "optimizer_kwargs", "optimizer_impl", "amp",
                   "checkpoint_classes", "grad_accum", "loss", "dtype", "sdpa", "alloc_conf", "units", "output",
                   "debug")


def _spec_text(value: str) -> str:
    validate_inputs([value], symbolic=None)
    return str(value)


# [NAME=]DIMS[:DTYPE] where one dimension may be a capital letter (Bx1000) -> the text
SpecTextType = lambda: ParsedType("[NAME=]DIMS[:DTYPE]", _spec_text)
# 80GiB, 80GB, 512MiB, 123456B, or 0.9 / 90% of --gpu -> BudgetAmount
BudgetType = lambda: ParsedType("BYTES|FRACTION", parse_budget, BudgetAmount)
# 5% or 0.05 -> Fraction
MarginType = lambda: ParsedType("PERCENT", parse_margin, Fraction)


def _preflight_options(command: Callable[..., None]) -> Callable[..., None]:
    """Add --input, --budget, --gpu, --margin, --device, --mode, --format and the analyze
    command's step options (the same click Option objects) to a pre-flight command."""
    shared = {p.name: p for p in analyze_command.params}
    own = [
        click.Option(["--input", "-i", "inputs"], type=SpecTextType(), multiple=True, required=True,
                     help="Example input, repeatable (as for analyze); max-batch / max-seq: one dimension is "
                          "a capital letter to search, e.g. Bx1000 or 1xSx64."),
        click.Option(["--budget"], type=BudgetType(), default=None,
                     help="Memory available: 123456B, 512MiB, 80GiB, 80GB (decimal), or 0.9 / 90% of --gpu. "
                          "Default: all of --gpu's memory."),
        click.Option(["--gpu"], default=None, metavar="NAME",
                     help=f"Target this GPU ({', '.join(GPUS)}): implies --device cuda and, without --budget, "
                          "its memory is the budget."),
        click.Option(["--margin"], type=MarginType(), default="0%", show_default=True,
                     help="Keep this share free: fits when peak x (1 + margin) <= budget."),
        click.Option(["--device"], type=click.Choice(DEVICES), default=None,
                     help="Target device (default: cuda with --gpu, else cpu). cuda compares the allocated peak."),
        click.Option(["--mode"], type=click.Choice(PREFLIGHT_MODES), default="train", show_default=True,
                     help="Check the training step or inference."),
        click.Option(["--format", "fmt"], type=click.Choice(["table", "json"]), default="table",
                     show_default=True, help="Output format."),
    ]
    params = [*own, *(shared[name] for name in _SHARED_OPTIONS)]
    command.__click_params__ = [*getattr(command, "__click_params__", []), *reversed(params)]  # type: ignore[attr-defined]
    return command


def _preflight_job(target: tuple[str, ModelSource], inputs: tuple[str, ...], mode: str, device: str | None,
                   gpu: str | None, options: dict[str, Any]) -> tuple[Job, Context]:
    """The Job to analyse and the header's context, from the command's options."""
    name, source = target
    device = device or ("cuda" if gpu else "cpu")
    dtype = options["dtype"]
    analyze_options = dict(
        kwargs=options["model_kwargs"], optimizer=options["optimizer"], optimizer_kwargs=options["optimizer_kwargs"],
        optimizer_impl=options["optimizer_impl"], amp=options["amp"], grad_accum=options["grad_accum"],
        checkpoint=[c.strip() for c in options["checkpoint_classes"].split(",") if c.strip()],
        loss=options["loss"], dtype=parse_dtype(dtype) if dtype else None, device=device, sdpa=options["sdpa"],
        alloc_conf=options["alloc_conf"], assume=dict(parse_assumption(a) for a in options["assumptions"]),
        **({"gpu": gpu} if gpu else {}))
    context = Context(target=name, inputs=inputs, device=device, mode=mode, gpu=get_gpu(gpu).name if gpu else None)
    return Job(model=source, inputs=inputs, mode=mode, options=analyze_options), context


def _write(text: str, output: str | None) -> None:
    if output:
        with open(output, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        click.echo(text, nl=False)


def _preflight_errors(debug: bool) -> contextlib.AbstractContextManager[None]:
    """As _errors_to_exit_codes, but a bug exits 3 (exit 1 means "does not fit") and --debug
    prints the traceback and keeps the exit code."""
    return _errors_to_exit_codes(debug, bug_exit=3, debug_keeps_code=True)


@main.command("check")
@click.argument("target", type=TargetType())
@_preflight_options
def check_command(target: tuple[str, ModelSource], inputs: tuple[str, ...], budget: BudgetAmount | None,
                  gpu: str | None, margin: Fraction, device: str | None, mode: str, fmt: str, units: str,
                  output: str | None, debug: bool, **options: Any) -> None:
    """Will TARGET fit the budget?  Exit 0: the predicted peak (allocated on cuda) with --margin
    fits; 1: it does not; 2: usage error; 3: the analysis failed.

    Example: graphmem check examples/mlp.py:MLP --input 32x1000 --budget 16MiB --margin 5%
    """
    with _preflight_errors(debug):
        job, context = _preflight_job(target, inputs, mode, device, gpu, options)
        limit = resolve_budget(budget, get_gpu(gpu) if gpu else None, margin)
        result = check(job, limit)
        text = CHECK_RENDERERS[fmt](result, context, units)
    _write(text, output)
    click.get_current_context().exit(0 if result.fits else 1)


@main.command("max-batch")
@click.argument("target", type=TargetType())
@_preflight_options
def max_batch_command(target: tuple[str, ModelSource], inputs: tuple[str, ...], budget: BudgetAmount | None,
                      gpu: str | None, margin: Fraction, device: str | None, mode: str, fmt: str, units: str,
                      output: str | None, debug: bool, **options: Any) -> None:
    """The largest batch (max-batch) or sequence length (max-seq) that fits: the dimension written
    as a capital letter in --input (Bx1000, 1xSx64).  N fits and N+1 does not, both analysed.
    Exit 0 when some value fits, 1 when even 1 does not.

    Example: graphmem max-batch examples/mlp.py:MLP --input Bx1000 --budget 64MiB
    """
    key = "max_seq" if click.get_current_context().info_name == "max-seq" else "max_batch"
    with _preflight_errors(debug):
        job, context = _preflight_job(target, inputs, mode, device, gpu, options)
        limit = resolve_budget(budget, get_gpu(gpu) if gpu else None, margin)
        result = search_largest(job, limit)
        text = SEARCH_RENDERERS[fmt](result, context, units, key=key)
    _write(text, output)
    click.get_current_context().exit(0 if result.max_value else 1)


main.add_command(max_batch_command, name="max-seq")


@main.command("plan")
@click.argument("target", type=TargetType())
@_preflight_options
@click.option("--world-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="GPUs the ZeRO / FSDP rows shard over (formula rows).")
@click.option("--prune-amount", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.5,
              show_default=True, help="Share of each Linear/Conv weight the pruning rows remove.")
@click.option("--group-size", type=click.IntRange(min=1), default=128, show_default=True,
              help="int4 quantization group size (formula rows).")
def plan_command(target: tuple[str, ModelSource], inputs: tuple[str, ...], budget: BudgetAmount | None,
                 gpu: str | None, margin: Fraction, device: str | None, mode: str, fmt: str, units: str,
                 output: str | None, debug: bool, world_size: int, prune_amount: float, group_size: int,
                 **options: Any) -> None:
    """What to change so TARGET fits: each remedy (batch, checkpointing, autocast, optimizer,
    accumulation, ZeRO/FSDP, offload, quantization, pruning) alone and combined, ranked, with its
    predicted peak, saving and extra compute; and why training takes N times inference.

    Example: graphmem plan examples/gpt.py:GPT --input 8x256:int64 --loss cross_entropy --budget 64MiB
    """
    with _preflight_errors(debug):
        job, context = _preflight_job(target, inputs, mode, device, gpu, options)
        limit = resolve_budget(budget, get_gpu(gpu) if gpu else None, margin)
        plan = make_plan(job, limit, world_size=world_size, prune_amount=prune_amount, group_size=group_size)
        text = PLAN_RENDERERS[fmt](plan, context, units)
    _write(text, output)
