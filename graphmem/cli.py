"""Stage 5: the command line.  The only module that imports click.

Turns strings into specs, calls ``graphmem.analyze`` once, renders with the renderer the
``--format`` name picks, writes the output, and maps errors to exit codes:
0 success; 2 usage errors (bad TARGET, --input, option); 3 analysis failures; 1 a bug.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from graphmem import __version__
from graphmem.api import ANALYSIS_MODES, DEVICES, analyze
from graphmem.errors import GraphmemError, UserInputError
from graphmem.cuda import SDPA_CHOICES
from graphmem.gpus import GPUS
from graphmem.load import ModelSource, load_hf_config, resolve_target
from graphmem.presets import PRESETS
from graphmem.report import COLLAPSE_CHOICES, RENDERERS, UNIT_CHOICES, check_output_path, write_files
from graphmem.spec import MODEL_DTYPES, InputSpec, parse_dtype, parse_input_spec
from graphmem.values import parse_assumption
from graphmem.step import AMP_DTYPES, LOSSES, OPTIMIZER_CHOICES, OPTIMIZER_IMPLS

__all__ = ["main"]


class TargetType(click.ParamType):
    """``pkg.module:Attr`` or ``path/file.py:Attr`` -> the imported class, factory or module."""

    name = "TARGET"

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[str, ModelSource]:
        if isinstance(value, tuple):
            return value
        try:
            return value, resolve_target(value)
        except UserInputError as exc:
            self.fail(str(exc), param, ctx)


class InputSpecType(click.ParamType):
    """``[NAME=]DIMS[:DTYPE]`` -> InputSpec."""

    name = "[NAME=]DIMS[:DTYPE]"

    def convert(self, value: Any, param: Any, ctx: Any) -> InputSpec:
        if isinstance(value, InputSpec):
            return value
        try:
            return parse_input_spec(value)
        except UserInputError as exc:
            self.fail(str(exc), param, ctx)


class JsonObjectType(click.ParamType):
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
@click.option("--hf-config", type=click.Path(dir_okay=False), default=None,
              help="A local config.json for a transformers model class TARGET (e.g. transformers:LlamaForCausalLM).")
@click.option("--hf-config-kwargs", type=JsonObjectType(), default=None,
              help="JSON object of config values for a transformers model class (override --hf-config).")
@click.option("--input", "-i", "inputs", type=InputSpecType(), multiple=True, required=True,
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
def analyze_command(target: tuple[str, ModelSource] | None, preset: str | None, hf_config: str | None,
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


class _errors_to_exit_codes:
    """Context manager: GraphmemError -> 'Error: ...' and its exit code; bugs -> exit 1."""

    def __init__(self, debug: bool) -> None:
        self.debug = debug

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or self.debug or isinstance(exc, (click.ClickException, KeyboardInterrupt)):
            return False
        if isinstance(exc, GraphmemError):
            error = click.ClickException(str(exc))
            error.exit_code = exc.exit_code
            raise error from None
        click.echo(f"Error: internal error: {type(exc).__name__}: {exc} "
                   "(rerun with --debug for the traceback, and please report it)", err=True)
        sys.exit(1)
