"""One ``Job``: everything that says what is analysed, built and validated in one place.

The command line (graphmem.cli.options) and the Python keywords (``make_job``, used by
``graphmem.analyze(model, inputs, **keywords)``) both build a Job; every later stage takes
it whole.  A Job is a description, not a result: the preset is applied (``with_preset``)
and the model is built by the pipeline (graphmem.api), never here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from graphmem.cuda.alloc_conf import parse_alloc_conf
from graphmem.cuda.gpus import get_gpu
from graphmem.cuda.nccl import DEFAULT_NCCL_BUFFER_MB
from graphmem.errors import UserInputError
from graphmem.job.choices import ANALYSIS_MODES, DEFAULT_GPU, DEVICES, SDPA_CHOICES
from graphmem.job.finetune import LoraSpec, parse_freeze, parse_lora, parse_quantize_base
from graphmem.job.grammar import parse_blocks, parse_save_in
from graphmem.job.load import ModelSource
from graphmem.job.parallel import ParallelSpec, parse_parallel
from graphmem.job.presets import get_preset
from graphmem.job.sample import Sample, read_sample
from graphmem.job.spec import MODEL_DTYPES, GenerateSpec, InputSpec, parse_dtype, parse_generate, validate_inputs
from graphmem.job.step import StepConfig

__all__ = ["ANALYSIS_MODES", "DEFAULT_GPU", "DEVICES", "SDPA_CHOICES", "Job", "make_job"]

_STEP_FIELDS = frozenset(f.name for f in fields(StepConfig))


@dataclass(frozen=True, slots=True)
class Job:
    """What to analyse.  Checked when built: a Job that exists is a valid one.

    Attributes:
        model: ``"pkg.module:Attr"`` / ``"file.py:Attr"``, an nn.Module class, a factory
            returning one, or an nn.Module instance (left untouched); None with ``preset``.
        inputs: example inputs as ``[NAME=]DIMS[:DTYPE]`` texts; one dimension may be a
            capital letter (``Bx1000``), which only the pre-flight search accepts.
        mode: ``both``, ``train`` or ``inference``.
        step: how the training step runs (optimizer, loss, autocast, checkpointing, ...).
        device: the target device, ``cpu`` or ``cuda``.
        dtype: the model converted as ``model.to(dtype)``; None keeps it (or the preset's).
        model_kwargs: keyword arguments for the model class or factory.
        hf_config: config values for a transformers model class (no download ever).
        preset: a name from graphmem.job.presets.PRESETS.
        generate: inference with a KV cache instead of ``mode``.
        assume: input name -> value (``ones``, ``zeros``, ``arange`` or an integer) for the
            reads of input-derived values.
        gpu: the CUDA target's GPU, a name from graphmem.cuda.gpus.GPUS.
        sdpa: the CUDA target's attention backend, one of SDPA_CHOICES.
        alloc_conf: the CUDA target's PYTORCH_CUDA_ALLOC_CONF; None reads the environment.
        parallel: data-parallel or sharded training over several GPUs; the report then holds
            each distinct rank and the highest one.
        name: how reports name the model; None: the target text, the preset or the class.
        freeze: globs on parameter names (``model.layers.0.*``; ``all-but:GLOB``) whose
            parameters do not train (graphmem.job.finetune).
        lora: peft's LoRA adapters on the built model; only they train.
        quantize_base: with ``lora``, the base's linear layers quantized as bitsandbytes
            loads them (QLoRA): a graphmem.job.finetune.QUANTIZED_BASES kind.
        sample: the example batch with its values (graphmem.job.sample); ``inputs`` are its specs.
    """

    model: str | ModelSource | None = None
    inputs: tuple[str, ...] = ()
    mode: str = "both"
    step: StepConfig = field(default_factory=StepConfig)
    device: str = "cpu"
    dtype: torch.dtype | None = None
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    hf_config: Mapping[str, Any] | None = None
    preset: str | None = None
    generate: GenerateSpec | None = None
    assume: Mapping[str, str] = field(default_factory=dict)
    gpu: str = DEFAULT_GPU
    sdpa: str = "auto"
    alloc_conf: str | None = None
    parallel: ParallelSpec | None = None
    name: str | None = None
    freeze: tuple[str, ...] = ()
    lora: LoraSpec | None = None
    quantize_base: str | None = None
    sample: Sample | None = None

    def __post_init__(self) -> None:
        self.step.validate()
        if self.quantize_base is not None and self.lora is None:
            raise UserInputError("--quantize-base needs --lora: quantized base weights do not train, so QLoRA "
                                 "trains LoRA adapters on them (e.g. --lora r=16,alpha=32,target=all-linear)")
        if self.quantize_base is not None and self.parallel is not None and (
                self.parallel.parallelize is not None or any(name != "ddp" for name, _ in self.parallel.degrees)):
            raise UserInputError(f"--quantize-base with --parallel {self.parallel.text}: only DDP (ddp=N) is modelled "
                                 "for a quantized base; sharding the packed weights (FSDP-QLoRA), ZeRO, tensor and "
                                 "pipeline parallelism are not")
        if self.freeze and self.lora is not None:
            raise UserInputError("--freeze and --lora together: LoRA already freezes every weight but its "
                                 "adapters; give one of them")
        for value, choices, what in ((self.mode, ANALYSIS_MODES, "mode"), (self.device, DEVICES, "device"),
                                     (self.sdpa, SDPA_CHOICES, "sdpa backend")):
            if value not in choices:
                raise UserInputError(f"unknown {what} {value!r}; expected one of: {', '.join(choices)}")
        if self.inputs or (self.generate is None and self.preset is None):
            validate_inputs(self.inputs, symbolic=None)
        if self.preset is not None:
            get_preset(self.preset)
        if self.parallel is not None and self.generate is not None:
            raise UserInputError("--parallel applies to training and inference, not to --generate")
        if self.device == "cuda":
            get_gpu(self.gpu)
            if self.alloc_conf is not None:
                parse_alloc_conf(self.alloc_conf)

    @property
    def target_name(self) -> str:
        """How reports name the model."""
        if self.name:
            return self.name
        model = self.model
        return str(self.preset or (model if isinstance(model, str) else
                                   getattr(model, "__qualname__", type(model).__name__)))

    def with_preset(self) -> Job:
        """The job with its preset applied: the preset's model class, its config under
        ``hf_config``, its published dtype unless one is given, and its example batch
        when no input is given; without a dtype, a Hugging Face config's own ``torch_dtype``
        (what from_pretrained would load the weights in); without a model, the class the
        config's ``architectures`` names."""
        job = self
        if self.preset is not None:
            chosen = get_preset(self.preset)
            inputs = self.inputs or (() if self.generate else tuple(chosen.example_input.split()))
            job = replace(self, model=self.model or chosen.target,
                          hf_config={**chosen.config, **(self.hf_config or {})}, dtype=self.dtype or chosen.dtype,
                          inputs=inputs)
        declared = _config_dtype(job.hf_config)
        if job.dtype is None and declared is not None:
            job = replace(job, dtype=declared)
        architectures = (job.hf_config or {}).get("architectures")
        if job.model is None and isinstance(architectures, list) and architectures:  # a Hub config names it
            job = replace(job, model=f"transformers:{architectures[0]}", name=job.name or None)
        return job

    def updated(self, **changes: Any) -> Job:
        """The same job with some fields changed, by Job field or ``make_job`` keyword
        (``optimizer="sgd"``, ``amp="bf16"``, ``checkpoint=["Block"]``, ``kwargs={...}``)."""
        step = {key: changes.pop(key) for key in list(changes) if key in _STEP_FIELDS}
        for key in ("checkpoint", "checkpoint_save"):
            if key in step:
                step[key] = _class_names(step[key])
        for key in ("checkpoint_blocks", "checkpoint_save_blocks"):
            if key in step:
                step[key] = _blocks(step[key])
        if "checkpoint_save_in" in step:
            step["checkpoint_save_in"] = _save_in(step["checkpoint_save_in"])
        if "kwargs" in changes:
            changes["model_kwargs"] = dict(changes.pop("kwargs") or {})
        if "inputs" in changes:
            changes["inputs"] = _input_texts(changes["inputs"])
        if isinstance(changes.get("dtype"), str):
            changes["dtype"] = parse_dtype(changes["dtype"])
        if "freeze" in changes:
            changes["freeze"] = parse_freeze(changes["freeze"] or ())
        if isinstance(changes.get("lora"), str):
            changes["lora"] = parse_lora(changes["lora"])
        if "quantize_base" in changes:
            changes["quantize_base"] = parse_quantize_base(changes["quantize_base"])
        return replace(self, step=replace(self.step, **step) if step else self.step, **changes)


def make_job(model: str | ModelSource | None = None,
             inputs: Sequence[InputSpec | str | torch.Tensor] | InputSpec | str | torch.Tensor = (), *,
             mode: str = "both", optimizer: str = "adam", loss: str = "auto", device: str | None = None,
             dtype: torch.dtype | str | None = None, kwargs: Mapping[str, Any] | None = None,
             optimizer_kwargs: Mapping[str, Any] | None = None, optimizer_impl: str = "auto",
             amp: str | None = None, checkpoint: Sequence[str] | str = (), checkpoint_every: int = 1,
             checkpoint_save: Sequence[str] | str = (), checkpoint_blocks: Sequence[int] | str = (),
             checkpoint_save_blocks: Sequence[int] | str = (),
             checkpoint_save_in: Mapping[int, Sequence[str]] | str = "", grad_accum: int = 1,
             gpu: str | None = None, sdpa: str = "auto", alloc_conf: str | None = None,
             assume: Mapping[str, str] | None = None, hf_config: Mapping[str, Any] | None = None,
             preset: str | None = None, generate: str | GenerateSpec | None = None, batch: int = 1,
             parallel: str | ParallelSpec | None = None, ddp_bucket_mb: float = 25.0,
             ddp_bucket_view: bool = False, reshard_after_forward: bool | None = None,
             fsdp_keep_units: Sequence[int] | str = (), mp_param_dtype: str | None = None,
             mp_reduce_dtype: str | None = None,
             fsdp_units: Sequence[str] | str = (), tp_plan: str | Mapping[str, Any] | None = None,
             parallelize: str | Callable[..., Any] | None = None, microbatches: int | None = None,
             schedule: str = "1f1b", nccl_buffer_mb: float = DEFAULT_NCCL_BUFFER_MB,
             name: str | None = None, freeze: Sequence[str] | str = (), lora: str | LoraSpec | None = None,
             quantize_base: str | None = None,
             sample: str | Sample | torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | None = None
             ) -> Job:
    """A Job from the keywords of ``graphmem.analyze`` (see Job for their meaning).

    ``device`` None is cuda when ``gpu`` is given, else cpu; ``gpu`` None is DEFAULT_GPU.
    ``generate`` is ``"P+N"`` (a P-token prompt, N new tokens) with ``batch`` sequences.
    ``parallel`` is ``"fsdp=8"``, ``"ddp=8"``, ``"ddp=2,fsdp=4"`` or ``"zero1=8"``
    (graphmem.job.parallel), with the engines' settings: DDP's ``bucket_cap_mb`` and
    ``gradient_as_bucket_view``; FSDP2's ``reshard_after_forward`` (and ``fsdp_keep_units``, the
    units, 0-based, that keep their parameters after forward whatever it says), MixedPrecisionPolicy
    dtypes and the classes of the modules sharded as units; with ``tp``, ``tp_plan`` (module
    name -> "colwise" / "rowwise" / ..., or ``"pkg.module:PLAN"``; default: the transformers
    model's own ``base_model_tp_plan``).  ``parallelize`` is your own
    ``fn(model, mesh)`` (or ``"pkg.module:fn"``), run instead of graphmem's strategies on the
    mesh ``parallel`` describes.  With ``pp``, ``microbatches`` (default: the degree) and
    ``schedule`` (``gpipe`` or ``1f1b``).  On the CUDA target, ``nccl_buffer_mb``: MiB of
    NCCL's own buffers per communicator (graphmem.cuda.nccl).  Fine-tuning: ``freeze``
    (``["model.embed_tokens.*", "model.layers.0.*"]``) or ``lora``
    (``"r=16,alpha=32,target=q_proj,v_proj"``, peft's LoRA; graphmem.job.finetune), with
    ``quantize_base`` (``"nf4"``) for QLoRA.  ``sample``: the example batch with its values (a
    ``.pt`` / ``.safetensors`` file, ``module:function``, or tensors; graphmem.job.sample), in
    place of ``inputs``.

    Raises:
        UserInputError: any invalid value, before anything is imported or traced.
    """
    step = StepConfig(optimizer=optimizer, optimizer_kwargs=dict(optimizer_kwargs or {}),
                      optimizer_impl=optimizer_impl, loss=loss, amp=amp, checkpoint=_class_names(checkpoint),
                      checkpoint_every=checkpoint_every, checkpoint_save=_class_names(checkpoint_save),
                      checkpoint_blocks=_blocks(checkpoint_blocks),
                      checkpoint_save_blocks=_blocks(checkpoint_save_blocks),
                      checkpoint_save_in=_save_in(checkpoint_save_in), grad_accum=grad_accum)
    if isinstance(generate, str):
        generate = parse_generate(generate, batch)
    if isinstance(parallel, str):
        parallel = replace(parse_parallel(parallel), bucket_mb=ddp_bucket_mb, bucket_view=ddp_bucket_view,
                           reshard_after_forward=reshard_after_forward, keep_units=_blocks(fsdp_keep_units),
                           param_dtype=mp_param_dtype,
                           reduce_dtype=mp_reduce_dtype, units=_class_names(fsdp_units), tp_plan=tp_plan,
                           parallelize=parallelize, microbatches=microbatches, schedule=schedule,
                           nccl_buffer_mb=nccl_buffer_mb)
    elif parallelize is not None or tp_plan is not None or microbatches is not None:
        raise UserInputError("--parallelize, --tp-plan and --microbatches need --parallel to describe the mesh, "
                             "e.g. --parallel fsdp=8, tp=2 or pp=4")
    if sample is not None:
        if inputs:
            raise UserInputError("--sample and --input both given: the sample's tensors are the inputs (their "
                                 "shapes, dtypes and values); give one of them")
        sample = read_sample(sample)
        inputs = sample.specs
    return Job(model=model, inputs=_input_texts(inputs), mode=mode, step=step,
               device=device or ("cuda" if gpu else "cpu"),
               dtype=parse_dtype(dtype) if isinstance(dtype, str) else dtype, model_kwargs=dict(kwargs or {}),
               hf_config=hf_config, preset=preset, generate=generate, assume=dict(assume or {}),
               gpu=gpu or DEFAULT_GPU, sdpa=sdpa, alloc_conf=alloc_conf, parallel=parallel, name=name,
               freeze=parse_freeze(freeze), lora=parse_lora(lora) if lora is not None else None,
               quantize_base=parse_quantize_base(quantize_base), sample=sample)


def _config_dtype(config: Mapping[str, Any] | None) -> torch.dtype | None:
    """A config.json's ``torch_dtype`` (or ``dtype``), when it names a float dtype."""
    value = (config or {}).get("torch_dtype") or (config or {}).get("dtype")
    if not isinstance(value, str) or value.removeprefix("torch.") not in MODEL_DTYPES:
        return None
    return parse_dtype(value)


def _input_texts(inputs: Sequence[InputSpec | str | torch.Tensor] | InputSpec | str | torch.Tensor) -> tuple[str, ...]:
    """Input specs as text; an example tensor stands for its shape and dtype (never its values)."""
    if isinstance(inputs, (str, InputSpec, torch.Tensor)):
        inputs = [inputs]
    return tuple(str(InputSpec(tuple(spec.shape), spec.dtype)) if isinstance(spec, torch.Tensor) else str(spec)
                 for spec in inputs)


def _blocks(blocks: Sequence[int] | str) -> tuple[int, ...]:
    """``"0-3,6"`` or ``[0, 1, 2, 3, 6]`` -> ``(0, 1, 2, 3, 6)`` (graphmem.job.grammar.parse_blocks)."""
    return parse_blocks(blocks) if isinstance(blocks, str) else tuple(sorted(int(b) for b in blocks))


def _save_in(save_in: Mapping[int, Sequence[str]] | Sequence[tuple[int, Sequence[str]]] | str
             ) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """``"0=attn.proj:matmuls"`` or ``{0: ["attn.proj:matmuls"]}`` -> ``((0, ("attn.proj:matmuls",)),)``
    (graphmem.job.grammar.parse_save_in)."""
    if isinstance(save_in, str):
        return parse_save_in(save_in)
    pairs = save_in.items() if isinstance(save_in, Mapping) else save_in
    return tuple(sorted((int(block), _class_names(names)) for block, names in pairs))


def _class_names(classes: Sequence[str] | str) -> tuple[str, ...]:
    """``"A,B"`` or ``["A", "B"]`` -> ``("A", "B")``."""
    if isinstance(classes, str):
        classes = classes.split(",")
    return tuple(c.strip() for c in classes if c.strip())
