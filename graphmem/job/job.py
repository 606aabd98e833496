"""One ``Job``: everything that says what is analysed, as sections built and validated in one place.

The sections (graphmem.job.sections, step_config, parallel) each hold one part: ``model``,
``inputs``, ``generate``, ``step``, ``finetune``, ``target``, ``parallel``; each of their
settings is one field carrying its option (graphmem.job.option), from which the command line,
the Python keywords (``make_job``, below) and the report's setup are derived.  A new
setting is a field in a section, never a new flat flag.  A Job is a description, not a result:
the preset is applied (``with_preset``) and the model is built by the pipeline (graphmem.api).
Imports no torch (what needs it imports it when it runs).
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from graphmem.errors import UserInputError
from graphmem.job.choices import ANALYSIS_MODES, DEFAULT_GPU, DEVICES, MODEL_DTYPES, SDPA_CHOICES
from graphmem.job.generation import GENERATE, GenerateSpec
from graphmem.job.grammar import validate_inputs
from graphmem.job.option import Declared, declared, flag, fold, option, section
from graphmem.job.parallel import ParallelSpec
from graphmem.job.sections import Finetune, Inputs, ModelSpec, Target
from graphmem.job.step_config import StepConfig

if TYPE_CHECKING:
    import torch

__all__ = ["ANALYSIS_MODES", "DEFAULT_GPU", "DEVICES", "SDPA_CHOICES", "Job", "command_line", "edited",
           "keyword_values", "keywords", "make_job"]


@dataclass(frozen=True, slots=True)
class Job:
    """What to analyse.  Checked when built: a Job that exists is a valid one."""

    model: ModelSpec = field(default_factory=ModelSpec, metadata=section(ModelSpec))
    """What builds the model, its configuration and dtype (graphmem.job.sections)."""
    inputs: Inputs = field(default_factory=Inputs, metadata=section(Inputs))
    """The example batch: specs, sample values, values assumed."""
    generate: GenerateSpec | None = field(default=None, metadata=section(GenerateSpec, **GENERATE))
    """Inference with a KV cache instead of ``mode``."""
    mode: str = field(default="both", metadata=option(
        "--mode", choices=ANALYSIS_MODES, default="both", show_default=True,
        help="Analyse inference, a training step, or both."))
    """``both``, ``train`` or ``inference``."""
    step: StepConfig = field(default_factory=StepConfig, metadata=section(StepConfig))
    """How the training step runs (optimizer, loss, autocast, checkpointing, ...)."""
    finetune: Finetune | None = field(default=None, metadata=section(Finetune))
    """Frozen parameters or LoRA adapters; None: every parameter trains."""
    target: Target = field(default_factory=Target, metadata=section(Target))
    """The target device (and on cuda the GPU, its kernels and allocator)."""
    parallel: ParallelSpec | None = field(default=None, metadata=section(ParallelSpec))
    """Data-parallel or sharded training over several GPUs; the report then holds each distinct
    rank and the highest one."""

    def __post_init__(self) -> None:
        parallel = self.parallel
        if self.finetune is not None and self.finetune.quantize_base is not None and parallel is not None and (
                parallel.parallelize is not None or any(name != "ddp" for name, _ in parallel.degrees)):
            raise UserInputError(f"{flag(Finetune, 'quantize_base')} with {flag(ParallelSpec, 'degrees')} "
                                 f"{parallel.text}: only DDP (ddp=N) is modelled for a quantized base; sharding the "
                                 "packed weights (FSDP-QLoRA), ZeRO, tensor and pipeline parallelism are not")
        if self.mode not in ANALYSIS_MODES:
            raise UserInputError(f"unknown mode {self.mode!r}; expected one of: {', '.join(ANALYSIS_MODES)}")
        if self.inputs.specs or (self.generate is None and self.model.preset is None):
            validate_inputs(self.inputs.specs, symbolic=None)
        if parallel is not None and self.generate is not None:
            raise UserInputError(f"{flag(ParallelSpec, 'degrees')} applies to training and inference, not to "
                                 f"{GENERATE['graphmem.option'].name}")

    @property
    def target_name(self) -> str:
        """How reports name the model."""
        return self.model.shown_name

    def with_inputs(self, specs: Sequence[str]) -> Job:
        """The same job on other input specs (``[NAME=]DIMS[:DTYPE]`` texts)."""
        return replace(self, inputs=replace(self.inputs, specs=tuple(specs)))

    @property
    def device(self) -> str:
        """The target device, ``cpu`` or ``cuda``."""
        return self.target.device

    def with_preset(self) -> Job:
        """The job with its preset applied: the preset's model class, its config under
        ``hf_config``, its published dtype unless one is given, and its example batch
        when no input is given; without a dtype, a Hugging Face config's own ``torch_dtype``
        (what from_pretrained would load the weights in); without a model, the class the
        config's ``architectures`` names."""
        from graphmem.job.presets import get_preset

        job, model = self, self.model
        if model.preset is not None:
            chosen = get_preset(model.preset)
            inputs = job.inputs.specs or (() if job.generate else tuple(chosen.example_input.split()))
            model = replace(model, target=model.target or chosen.target,
                            hf_config={**chosen.config, **(model.hf_config or {})}, dtype=model.dtype or chosen.dtype)
            job = replace(job, inputs=replace(job.inputs, specs=inputs))
        declared = _config_dtype(model.hf_config)
        if model.dtype is None and declared is not None:
            model = replace(model, dtype=declared)
        architectures = (model.hf_config or {}).get("architectures")
        if model.target is None and isinstance(architectures, list) and architectures:  # a Hub config names it
            model = replace(model, target=f"transformers:{architectures[0]}", name=model.name or None)
        return replace(job, model=model) if model != job.model else job


def keywords() -> tuple[str, ...]:
    """Every keyword a Job takes, in the tree's order."""
    return tuple(found.option.keyword for found in declared(Job) if found.option is not None)


def make_job(model: Any = None, inputs: Any = (), **given: Any) -> Job:
    """A Job from the keywords of ``graphmem.analyze``: each setting of the tree by its keyword
    (``optimizer="sgd"``, ``gpu="h100-80gb"``, ``checkpoint=["Block"]``, ``parallel="fsdp=8"``...;
    docs/api.md lists them).

    Raises:
        TypeError: a keyword the tree does not declare.
        UserInputError: any invalid value, before anything is imported or traced.
    """
    unknown = sorted(set(given) - set(keywords()))
    if unknown:
        raise TypeError(f"make_job() got an unexpected keyword argument {unknown[0]!r}")
    return fold(Job, {"model": model, "inputs": inputs, **given})  # type: ignore[no-any-return]


def edited(job: Job, **changes: Any) -> Job:
    """``job`` with the settings ``changes`` names (by keyword) changed."""
    unknown = sorted(set(changes) - set(keywords()))
    if unknown:
        raise TypeError(f"unknown setting {unknown[0]!r}")
    return fold(Job, {**keyword_values(job), **changes})  # type: ignore[no-any-return]


def _value_at(job: Any, found: Declared) -> Any:
    """The setting's value; where a section on its path is absent, its default."""
    value = job
    for name in found.path:
        if value is None:
            return _default(found)
        value = getattr(value, name)
    return value


def _default(found: Declared) -> Any:
    field = found.field
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return found.option.default if found.option is not None else None


def command_line(**given: Any) -> str:
    """The command-line words giving these settings (by keyword, in the order given), each value as
    the command line writes it: ``command_line(checkpoint="Block", checkpoint_blocks=(0, 1, 2))``
    -> ``--checkpoint Block --checkpoint-blocks 0-2``.  A "Run it" line spells its options so."""
    options = {found.option.keyword: found.option for found in declared(Job) if found.option is not None}
    words: list[str] = []
    for keyword, value in given.items():
        option = options[keyword]
        if option.kind == "flag":
            words.append(option.flags[0].split("/")[0 if value else 1])
        else:
            words += [option.name, shlex.quote(option.text_of(value))]
    return " ".join(words)


def keyword_values(job: Job) -> dict[str, Any]:
    """The job's settings as keywords (each accepted back by ``make_job``)."""
    values: dict[str, Any] = {}
    for found in declared(type(job)):
        if found.option is not None:
            value = _value_at(job, found)
            back = found.option.from_field
            values[found.option.keyword] = back(value) if back is not None and value is not None else value
    return values


def _config_dtype(config: Mapping[str, Any] | None) -> torch.dtype | None:
    """A config.json's ``torch_dtype`` (or ``dtype``), when it names a float dtype."""
    from graphmem.job.spec import parse_dtype

    value = (config or {}).get("torch_dtype") or (config or {}).get("dtype")
    if not isinstance(value, str) or value.removeprefix("torch.") not in MODEL_DTYPES:
        return None
    return parse_dtype(value)
