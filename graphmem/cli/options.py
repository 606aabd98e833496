"""The options every command shares, parsed once into one ``Job``.

``job_options(modes, default_mode)`` adds the TARGET argument and every option that says what
is analysed (model, preset, config, inputs, the training step, device and GPU); ``job_from``
turns their values into a ``graphmem.job.Job``.  ``output_options`` adds --format, --units,
--output and --debug.

Parsing imports no torch: the choices and parsers come from modules that import none
(job.choices, job.grammar, job.lora_spec, report.formats, report.paths), so --help and usage
errors are printed at once.  What does need torch, the user's code or an optional package
(importing TARGET, finding peft for --lora) is done by ``GraphmemCommand`` once click has
parsed every other parameter, still as a usage error of that parameter.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from gettext import ngettext
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.core import ParameterSource

from graphmem.cli.process import set_progress, user_output_to_stderr
from graphmem.cuda.gpus import GPUS
from graphmem.cuda.nccl import DEFAULT_NCCL_BUFFER_MB
from graphmem.errors import UserInputError
from graphmem.job.choices import (
    AMP_CHOICES,
    DEFAULT_GPU,
    DEVICES,
    LOSSES,
    MODEL_DTYPES,
    OPTIMIZER_CHOICES,
    OPTIMIZER_IMPLS,
    PRESET_NAMES,
    QUANTIZED_BASES,
    SDPA_CHOICES,
)
from graphmem.job.grammar import parse_blocks, parse_save_in, validate_inputs
from graphmem.job.lora_spec import LoraSpec, read_lora, require_peft
from graphmem.report import UNIT_CHOICES
from graphmem.report.paths import check_destination
from graphmem.units import parse_duration

if TYPE_CHECKING:
    from graphmem.job.job import Job
    from graphmem.job.load import ModelSource

__all__ = ["JOB_OPTION_NAMES", "GraphmemCommand", "JsonObjectType", "ParsedType", "job_from", "job_options",
           "output_options"]

F = TypeVar("F", bound=Callable[..., Any])
_THEN = "graphmem.then"  # ctx.meta: the (parameter, value) pairs whose ``then`` is still to run


class ParsedType(click.ParamType):  # type: ignore[type-arg]  # generic only in click >= 8.2
    """A value parsed by one of graphmem's parsers; its UserInputError becomes a usage error.

    Args:
        name: the metavar shown in --help.
        parse: str -> value, raising UserInputError.
        done: values of this type are already parsed (click may convert defaults twice).
        then: value -> value, raising UserInputError: the part that needs torch, the user's
            code or an optional package, run by ``GraphmemCommand`` once every other
            parameter is parsed.
    """

    def __init__(self, name: str, parse: Callable[[str], Any], done: type | tuple[type, ...] = (),
                 then: Callable[[Any], Any] | None = None) -> None:
        self.name, self.parse, self.done, self.then = name, parse, done, then

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if self.done and isinstance(value, self.done):
            return value
        try:
            parsed = self.parse(value)
        except UserInputError as exc:
            self.fail(str(exc), param, ctx)
        if self.then is not None and ctx is not None:
            ctx.meta.setdefault(_THEN, []).append((param, parsed))
        elif self.then is not None:
            parsed = self.then(parsed)
        return parsed


class GraphmemCommand(click.Command):
    """A command whose ParsedType values are finished (``then``) once click has parsed every
    parameter: a usage error that needs no torch is shown before anything heavy is imported.

    The arguments (TARGET) are the last parameters click converts, after every option given;
    the defaults it converts after them cannot fail.  So the errors come in click's order, but
    for its check of unexpected extra arguments, which it makes last and so is made here after
    the ``then`` steps, as it was after TARGET's import."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        allowed, ctx.allow_extra_args = ctx.allow_extra_args, True
        try:
            rest = super().parse_args(ctx, args)
        finally:
            ctx.allow_extra_args = allowed
        for param, value in ctx.meta.pop(_THEN, []):
            if ctx.resilient_parsing:  # shell completion: nothing is imported
                continue
            try:
                ctx.params[str(param.name)] = param.type.then(value)
            except UserInputError as exc:
                raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
        if rest and not allowed and not ctx.resilient_parsing:  # click's own words (click.core.Command.parse_args)
            ctx.fail(ngettext("Got unexpected extra argument ({args})", "Got unexpected extra arguments ({args})",
                              len(rest)).format(args=" ".join(map(str, rest))))
        return rest


class JsonObjectType(click.ParamType):  # type: ignore[type-arg]
    """A JSON object given on the command line, e.g. ``'{"hidden": 256}'``."""

    name = "JSON"

    def convert(self, value: Any, param: Any, ctx: Any) -> dict[str, Any]:
        if isinstance(value, dict):
            return value
        try:
            data = json.loads(value)
        except json.JSONDecodeError as exc:
            self.fail(f"not valid JSON ({exc.msg} at column {exc.colno}): {_excerpt(value)}; "
                      "expected an object such as '{\"hidden\": 256}'", param, ctx)
        except (RecursionError, ValueError) as exc:  # nested past Python's limit; an int of 5,000 digits
            what = "nested too deeply" if isinstance(exc, RecursionError) else "with a number too long to read"
            self.fail(f"JSON {what}: {_excerpt(value)}; expected an object such as '{{\"hidden\": 256}}'",
                      param, ctx)
        if not isinstance(data, dict):
            self.fail(f"expected a JSON object such as '{{\"hidden\": 256}}', got {_excerpt(value)}", param, ctx)
        return data


def _excerpt(text: str, limit: int = 80) -> str:
    """``text`` quoted, cut to ``limit`` characters (a 100,000-character value makes no message)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


def _import_target(text: str) -> tuple[str, ModelSource]:
    """(the text, what it names), imported with the module's prints going to stderr."""
    from graphmem.job.load import resolve_target

    with user_output_to_stderr():
        return text, resolve_target(text)


def _with_peft(lora: LoraSpec) -> LoraSpec:
    """``lora``, once peft is found installed (UserInputError naming the extra otherwise)."""
    require_peft()
    return lora


def _destination(param: Any, path: str | None) -> str | None:
    """Refuse an output path no file can be written to, before anything is analysed."""
    try:
        return None if path is None else check_destination(path)
    except UserInputError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def _timeout(ctx: Any, param: Any, value: str | None) -> None:
    """Validate --timeout (graphmem.cli.supervisor, which runs the command, enforces it)."""
    if value is not None:
        try:
            parse_duration(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param=param) from None


def _spec_text(value: str) -> str:
    validate_inputs([value], symbolic=None)
    return str(value)


# pkg.module:Attr or path/file.py:Attr -> (the text, the imported class, factory or module), imported last
TargetType = lambda: ParsedType("TARGET", str, tuple, then=_import_target)
# [NAME=]DIMS[:DTYPE] where one dimension may be a capital letter (Bx1000) -> the text
SpecTextType = lambda: ParsedType("[NAME=]DIMS[:DTYPE]", _spec_text)


def _job_params(modes: Sequence[str], default_mode: str) -> list[click.Parameter]:
    """TARGET and the job options, in --help order."""
    return [
        click.Argument(["target"], type=TargetType(), required=False),
        click.Option(["--preset"], type=click.Choice(list(PRESET_NAMES)), default=None,
                     help="A well-known transformers model by its published config (no download); TARGET "
                          "may then be omitted."),
        click.Option(["--hf-config"], type=click.Path(dir_okay=False), default=None,
                     help="A local config.json for a transformers model class TARGET "
                          "(e.g. transformers:LlamaForCausalLM)."),
        click.Option(["--hf-config-kwargs"], type=JsonObjectType(), default=None,
                     help="JSON object of config values for a transformers model class (override --hf-config)."),
        click.Option(["--input", "-i", "inputs"], type=SpecTextType(), multiple=True,
                     help="Example input, repeatable: 32x1000, 8x512:int64, input_ids=2x128:int64. Unnamed "
                          "inputs are positional, named ones keyword arguments. Default dtype float32. "
                          "max-batch / max-seq: one dimension is a capital letter to search, e.g. Bx1000 "
                          "or 1xSx64."),
        click.Option(["--sample"], default=None, metavar="FILE|module:function",
                     help="The example batch itself, in place of --input: a .pt file (torch.save of a tensor, a "
                          "list of tensors or a dict of named ones), a .safetensors file, or module:function "
                          "returning one. Its shapes and dtypes are the inputs; its values are what the model "
                          "reads where sizes depend on values (graph edges, lengths, masks)."),
        click.Option(["--generate"], default=None, metavar="PROMPT+NEW",
                     help="Inference with a KV cache instead of --mode: the prefill of PROMPT tokens and the "
                          "last of NEW decode steps (causal LMs), e.g. 2048+512. --input is then optional."),
        click.Option(["--batch"], type=click.IntRange(min=1), default=1, show_default=True,
                     help="With --generate: sequences generated at once."),
        click.Option(["--assume", "assumptions"], multiple=True, metavar="NAME=VALUE",
                     help="Value of an integer input, used only where the model reads values "
                          "(if mask.all(), nonzero): ones, zeros, arange, an integer, or below:N (random integers "
                          "from 0 to N-1: token ids below the vocabulary, node indices). Defaults: *mask* "
                          "inputs ones, position_ids arange, others zeros. nonzero=F (0 <= F <= 1): sizes "
                          "that depend on values (nonzero, x[mask], unique, LLM.int8's outlier columns) keep F of "
                          "their most, instead of all (an upper bound). routing=uneven|balanced: how top-k / "
                          "argmax choices made from unknown values (an MoE router's) are spread; default uneven. "
                          "boxes=N: ground-truth boxes per image for a torchvision detection model trained "
                          "without targets; default 8. reads=N: a number the model reads from values it "
                          "computed (a predicted length, a condition on activations) is taken as N; without it "
                          "such a read stops the analysis. Repeatable."),
        click.Option(["--kwargs", "model_kwargs"], type=JsonObjectType(), default=None,
                     help="JSON object of keyword arguments for the model class or factory."),
        click.Option(["--mode"], type=click.Choice(list(modes)), default=default_mode, show_default=True,
                     help="Analyse inference, a training step" + (", or both." if "both" in modes else ".")),
        click.Option(["--optimizer"], default="adam", show_default=True, metavar="NAME|pkg.module:Class",
                     help="Optimizer of the training step: the real torch.optim class with its defaults "
                          f"({', '.join(OPTIMIZER_CHOICES)}; the *8bit ones are bitsandbytes sized by "
                          "formula), or any importable torch.optim.Optimizer subclass."),
        click.Option(["--optimizer-kwargs"], type=JsonObjectType(), default=None,
                     help="JSON object of extra optimizer arguments, e.g. '{\"lr\": 0.01, \"amsgrad\": true}'."),
        click.Option(["--optimizer-impl"], type=click.Choice(list(OPTIMIZER_IMPLS)), default="auto",
                     show_default=True, help="auto: what PyTorch picks for the target device (for-loop on CPU)."),
        click.Option(["--amp"], type=click.Choice(list(AMP_CHOICES)), default=None,
                     help="Mixed precision: torch.autocast around forward and loss; fp16 adds a GradScaler."),
        click.Option(["--checkpoint", "checkpoint_classes"], default="", metavar="CLASS[,CLASS]",
                     help="What-if: run every module of these classes under non-reentrant activation "
                          "checkpointing; the report shows the peak with and without it."),
        click.Option(["--checkpoint-every"], type=click.IntRange(min=1), default=1, show_default=True,
                     help="With --checkpoint: checkpoint only every K-th module of those classes (1st, K+1-th, ...)."),
        click.Option(["--checkpoint-blocks"], type=ParsedType("I[-J][,...]", parse_blocks, tuple), default="",
                     help="With --checkpoint: checkpoint only these of the modules of those classes (0-based, in "
                          "the model's order), e.g. 0-5,8: the choice graphmem plan --policy makes."),
        click.Option(["--checkpoint-save-blocks"], type=ParsedType("I[-J][,...]", parse_blocks, tuple), default="",
                     help="With --checkpoint-blocks and --checkpoint-save: only these blocks keep those outputs "
                          "(selective); the other chosen blocks are checkpointed whole."),
        click.Option(["--checkpoint-save"], default="", metavar="OPS",
                     help="With --checkpoint: selective activation checkpointing: keep the outputs of these ops "
                          "and recompute the rest: matmuls, every-2nd-matmul, attention, or aten op names "
                          "(aten.mm,aten.addmm); PATH:NAME keeps them only inside the block's submodule at PATH "
                          "(attn.proj:matmuls)."),
        click.Option(["--checkpoint-save-in"], type=ParsedType("I[-J]=OPS[;...]", parse_save_in, tuple), default="",
                     help="With --checkpoint-blocks: the outputs each of these blocks keeps, in place of "
                          "--checkpoint-save, e.g. 0=attn.proj:matmuls;2-3=matmuls,attention: the op-by-op "
                          "choice graphmem plan --policy makes."),
        click.Option(["--grad-accum"], type=click.IntRange(min=1), default=1, show_default=True,
                     help="Forward/backward micro-steps per optimizer step."),
        click.Option(["--loss"], type=click.Choice(LOSSES), default="auto", show_default=True,
                     help="auto: output.loss if present, else sum of the first float output; "
                          "cross_entropy/nll use int64 class targets."),
        click.Option(["--freeze"], multiple=True, metavar="GLOB[,GLOB]",
                     help="Fine-tuning: parameters whose names match do not train, e.g. 'model.embed_tokens.*' "
                          "or 'model.layers.[0-3].*' (a module's name matches all of its parameters); "
                          "all-but:GLOB freezes every other one. Repeatable."),
        click.Option(["--lora"], type=ParsedType("r=N,alpha=A,target=M[,M]", read_lora, LoraSpec, then=_with_peft),
                     default=None,
                     help="Fine-tuning with peft's LoRA: adapters of rank r on the target modules train, the "
                          "rest is frozen, e.g. r=16,alpha=32,target=q_proj,v_proj[,dropout=0.05] "
                          "(target=all-linear: every linear layer). Needs pip install 'graphmem[lora]'."),
        click.Option(["--quantize-base"], type=click.Choice(list(QUANTIZED_BASES)), default=None,
                     help="QLoRA, with --lora: the base model's linear layers in 4 or 8 bits, as transformers "
                          "loads them with a BitsAndBytesConfig (nf4-dq: double-quantized scales; int8: "
                          "LLM.int8, load_in_8bit); the compute dtype is --dtype. Needs pip install "
                          "'graphmem[qlora]'."),
        click.Option(["--dtype"], type=click.Choice(MODEL_DTYPES), default=None,
                     help="Convert the model's floating parameters and buffers, as model.to(dtype)."),
        click.Option(["--device"], type=click.Choice(DEVICES), default=None,
                     help="Target device whose allocations are predicted (default: cuda with --gpu, else "
                          "cpu). cuda: CUDA's kernel choices and the caching allocator (what "
                          "torch.cuda.max_memory_allocated / _reserved will say)."),
        click.Option(["--gpu"], default=None, metavar="NAME",
                     help=f"Target this GPU ({', '.join(GPUS)}); implies --device cuda. With --device cuda "
                          f"alone: {DEFAULT_GPU}."),
        click.Option(["--sdpa"], type=click.Choice(SDPA_CHOICES), default="auto", show_default=True,
                     help="With --device cuda: attention backend; auto is PyTorch's own choice for the GPU "
                          "and dtype."),
        click.Option(["--alloc-conf"], default=None, metavar="TEXT",
                     help="With --device cuda: PYTORCH_CUDA_ALLOC_CONF settings "
                          "(default: the environment variable), e.g. expandable_segments:True."),
        click.Option(["--parallel"], default=None, metavar="NAME=N[,NAME=N]",
                     help="Training spread over GPUs, applied by PyTorch's own engines; memory per GPU: "
                          "ddp=8 (DistributedDataParallel), fsdp=8 (FSDP2 fully_shard), ddp=2,fsdp=4 "
                          "(HSDP), zero1=8 (DDP with ZeroRedundancyOptimizer), tp=8 (tensor parallel; see "
                          "--tp-plan), fsdp=4,tp=2 (FSDP2 + tensor parallel, 2-D), pp=4 (pipeline parallel; see "
                          "--schedule)."),
        click.Option(["--parallelize"], default=None, metavar="pkg.module:fn",
                     help="With --parallel: your own fn(model, mesh) that applies your parallelism (the "
                          "one your trainer calls), run unchanged on the mesh --parallel describes."),
        click.Option(["--tp-plan"], default=None, metavar="pkg.module:PLAN",
                     help="With tp: a dict of module name (* matches one name) -> colwise | rowwise | "
                          "colwise_rep | rowwise_rep | sequence_parallel (default: a transformers model's own "
                          "base_model_tp_plan)."),
        click.Option(["--microbatches"], type=click.IntRange(min=1), default=None, metavar="M",
                     help="With --parallel pp=N: microbatches per step (default N; the batch must divide evenly)."),
        click.Option(["--schedule"], type=click.Choice(["gpipe", "1f1b"]), default="1f1b", show_default=True,
                     help="With --parallel pp=N: the pipeline schedule (ScheduleGPipe or Schedule1F1B)."),
        click.Option(["--fsdp-units"], default="", metavar="CLASS[,CLASS]",
                     help="With fsdp: the classes of the modules sharded as units (default: the model's "
                          "repeated blocks)."),
        click.Option(["--reshard-after-forward"], type=click.Choice(["default", "true", "false"]),
                     default="default", show_default=True,
                     help="With fsdp: fully_shard's reshard_after_forward (default: every unit but the root)."),
        click.Option(["--fsdp-keep-units"], type=ParsedType("I[-J][,...]", parse_blocks, tuple), default="",
                     help="With fsdp: these units (0-based, in the model's order; the root is none of them) keep "
                          "their parameters after forward (reshard_after_forward=False), the others as "
                          "--reshard-after-forward says: what graphmem plan --policy chooses unit by unit."),
        click.Option(["--mp-param-dtype"], type=click.Choice(MODEL_DTYPES), default=None,
                     help="With fsdp: MixedPrecisionPolicy param_dtype (the all-gathered parameters' dtype)."),
        click.Option(["--mp-reduce-dtype"], type=click.Choice(MODEL_DTYPES), default=None,
                     help="With fsdp: MixedPrecisionPolicy reduce_dtype (the gradients' reduce-scatter dtype)."),
        click.Option(["--ddp-bucket-mb"], type=click.FloatRange(min=0, min_open=True), default=25.0,
                     show_default=True, help="With ddp / zero1: DDP's bucket_cap_mb."),
        click.Option(["--ddp-bucket-view/--no-ddp-bucket-view"], default=False, show_default=True,
                     help="With ddp / zero1: DDP's gradient_as_bucket_view."),
        click.Option(["--nccl-buffer-mb"], type=click.FloatRange(min=0), default=DEFAULT_NCCL_BUFFER_MB,
                     show_default=True, metavar="MIB",
                     help="With --parallel on a GPU: MiB of NCCL's own buffers per communicator, outside "
                          "PyTorch's allocator (default: 32 channels x NCCL's default buffers of 4 MiB, "
                          "512 KiB and 4.7 MiB; docs/parallel.md)."),
    ]


# the parameter names job_options adds; job_from takes exactly these
JOB_OPTION_NAMES = tuple(str(p.name) for p in _job_params(("both",), "both"))


def job_options(modes: Sequence[str], default_mode: str) -> Callable[[F], F]:
    """Add TARGET and the job options to a command (``--mode`` with these choices)."""
    def add(command: F) -> F:
        params = _job_params(modes, default_mode)
        command.__click_params__ = [*getattr(command, "__click_params__", []), *reversed(params)]  # type: ignore[attr-defined]
        return command
    return add


def output_options(formats: Sequence[str]) -> Callable[[F], F]:
    """Add --format (these choices), --units, --output, --debug and --progress to a command."""
    def add(command: F) -> F:
        params = [
            click.Option(["--format", "fmt"], type=click.Choice(list(formats)), default="table", show_default=True,
                         help="Output format; json follows docs/json-schema.md."),
            click.Option(["--units"], type=click.Choice(UNIT_CHOICES), default="auto", show_default=True,
                         help="Units of sizes in tables (JSON is always in bytes)."),
            click.Option(["--output", "-o"], type=click.Path(dir_okay=False, writable=True), default=None,
                         callback=lambda c, p, v: _destination(p, v),
                         help="Write the report to this file instead of standard output (whole or not at all)."),
            click.Option(["--debug"], is_flag=True, help="Show the full traceback on errors."),
            click.Option(["--timeout"], metavar="DURATION", default=None, expose_value=False, callback=_timeout,
                         help="Stop after DURATION (90s, 10m, 2h) with exit 3, naming the stage reached  "
                              "[default: none]."),
            click.Option(["--progress/--no-progress"], default=None, expose_value=False, callback=set_progress,
                         help="Phase lines on stderr for work longer than two seconds  [default: on a terminal]."),
        ]
        command.__click_params__ = [*getattr(command, "__click_params__", []), *reversed(params)]  # type: ignore[attr-defined]
        return command
    return add


def job_from(options: Mapping[str, Any]) -> Job:
    """The Job the job options describe (``options``: the command's keyword arguments).

    With every job option but --input at its default (``graphmem analyze`` alone), make_job's
    first check, of the inputs, is made before the job modules (and torch) are imported: its
    refusal (no input given, two capital letters) comes at once.
    """
    context = click.get_current_context(silent=True)
    if context is not None and all(context.get_parameter_source(name) is ParameterSource.DEFAULT
                                   for name in JOB_OPTION_NAMES if name != "inputs"):
        validate_inputs(options["inputs"], symbolic=None)  # make_job's first check of such a job
    from graphmem.job.job import make_job
    from graphmem.job.load import load_hf_config
    from graphmem.job.spec import parse_assumption

    target: tuple[str, ModelSource] | None = options["target"]
    hf_config = load_hf_config(options["hf_config"], options["hf_config_kwargs"])
    name, source = target if target else (options["preset"] or _config_name(options["hf_config"], hf_config), None)
    return make_job(
        source, options["inputs"], mode=options["mode"], optimizer=options["optimizer"], loss=options["loss"],
        device=options["device"], dtype=options["dtype"], kwargs=options["model_kwargs"],
        optimizer_kwargs=options["optimizer_kwargs"], optimizer_impl=options["optimizer_impl"],
        amp=options["amp"], checkpoint=options["checkpoint_classes"], checkpoint_every=options["checkpoint_every"],
        checkpoint_save=options["checkpoint_save"], checkpoint_blocks=options["checkpoint_blocks"],
        checkpoint_save_blocks=options["checkpoint_save_blocks"], checkpoint_save_in=options["checkpoint_save_in"],
        grad_accum=options["grad_accum"],
        gpu=options["gpu"], sdpa=options["sdpa"], alloc_conf=options["alloc_conf"],
        assume=dict(parse_assumption(a) for a in options["assumptions"]),
        hf_config=hf_config, preset=options["preset"],
        generate=options["generate"], batch=options["batch"], parallel=options["parallel"],
        ddp_bucket_mb=options["ddp_bucket_mb"], ddp_bucket_view=options["ddp_bucket_view"],
        nccl_buffer_mb=options["nccl_buffer_mb"],
        reshard_after_forward={"default": None, "true": True, "false": False}[options["reshard_after_forward"]],
        fsdp_keep_units=options["fsdp_keep_units"],
        mp_param_dtype=options["mp_param_dtype"], mp_reduce_dtype=options["mp_reduce_dtype"],
        fsdp_units=options["fsdp_units"], tp_plan=options["tp_plan"], parallelize=options["parallelize"],
        microbatches=options["microbatches"], schedule=options["schedule"],
        freeze=options["freeze"], lora=options["lora"], quantize_base=options["quantize_base"], name=name,
        sample=options["sample"])


def _config_name(path: str | None, config: Mapping[str, Any] | None) -> str | None:
    """``LlamaForCausalLM (from conf/config.json)``: the class a config names (its first
    ``architectures``, else its ``model_type``) and where it came from; the path alone when it
    names neither."""
    if path is None:
        return None
    architectures = (config or {}).get("architectures")
    named = architectures[0] if isinstance(architectures, list) and architectures else (config or {}).get("model_type")
    return f"{named} (from {path})" if isinstance(named, str) and named else path
