"""A Job's sections besides the step and the parallelism: the model, the inputs, the target
device, fine-tuning and generation.  Each is a frozen dataclass checked in its own
``__post_init__``; each field that is a setting carries its option (graphmem.job.option).

Imports no torch: the command line derives its options from these fields before anything
heavy is loaded (the conversions that need torch import it when they run).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from graphmem.cuda.alloc_conf import alloc_conf_from_environment, parse_alloc_conf
from graphmem.cuda.gpus import GPUS, get_gpu
from graphmem.errors import UserInputError
from graphmem.job.choices import DEFAULT_GPU, DEVICES, MODEL_DTYPES, PRESET_NAMES, QUANTIZED_BASES, SDPA_CHOICES
from graphmem.job.grammar import validate_inputs
from graphmem.job.lora_spec import LoraSpec, read_lora, require_peft
from graphmem.job.option import flag, option, section, shown

if TYPE_CHECKING:
    import torch

    from graphmem.job.load import ModelSource
    from graphmem.job.sample import Sample

__all__ = ["CudaTarget", "Finetune", "Inputs", "ModelSpec", "Target"]


def _dtype(value: Any) -> torch.dtype | None:
    from graphmem.job.spec import parse_dtype

    return parse_dtype(value) if isinstance(value, str) else value


def _target(value: Any) -> Any:
    # the command line's TARGET is (its text, what it names); the Python keyword what it names
    return value[1] if isinstance(value, tuple) else value


def _import_target(text: str) -> tuple[str, Any]:
    from graphmem.job.load import resolve_target

    return text, resolve_target(text)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The model: what builds it, its configuration, the dtype it is converted to, its name."""

    target: str | ModelSource | None = field(default=None, metadata=option(
        "TARGET", keyword="model", argument=True, parse=str, done=tuple, then=_import_target, to_field=_target))
    """``"pkg.module:Attr"`` / ``"file.py:Attr"``, an nn.Module class, a factory returning one, or
    an nn.Module instance (left untouched); None with ``preset``."""
    preset: str | None = field(default=None, metadata=option(
        "--preset", choices=PRESET_NAMES,
        help="A well-known transformers model by its published config (no download); TARGET may then be omitted."))
    """A name from graphmem.job.presets.PRESETS."""
    hf_config_file: str | None = field(default=None, metadata=option(
        "--hf-config", keyword="hf_config_file", kind="path",
        help="A local config.json for a transformers model class TARGET (e.g. transformers:LlamaForCausalLM)."))
    """The config.json ``hf_config`` was read from (or a Hub id cached locally); it names the model."""
    hf_config: Mapping[str, Any] | None = field(default=None, metadata=option(
        "--hf-config-kwargs", keyword="hf_config", kind="json",
        help="JSON object of config values for a transformers model class (override --hf-config)."))
    """Config values for a transformers model class (no download ever)."""
    kwargs: Mapping[str, Any] = field(default_factory=dict, metadata=option(
        "--kwargs", kind="json", to_field=lambda value: dict(value or {}),
        help="JSON object of keyword arguments for the model class or factory."))
    """Keyword arguments for the model class or factory."""
    dtype: torch.dtype | None = field(default=None, metadata=option(
        "--dtype", choices=MODEL_DTYPES, to_field=_dtype,
        help="Convert the model's floating parameters and buffers, as model.to(dtype).")
        | shown(key="dtype", at_json=20, json=lambda value, facts: _dtype_text(value), label="weights dtype",
                at_row=10, row=lambda value, facts: f"{_dtype_text(value)} (model.to)" if value else ""))
    """The model converted as ``model.to(dtype)``; None keeps it (or the preset's)."""
    name: str | None = field(default=None, metadata=option(keyword="name"))
    """How reports name the model; None: the target text, the preset or the class."""

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRESET_NAMES:
            from graphmem.job.presets import get_preset

            get_preset(self.preset)  # its message lists the presets

    @classmethod
    def fold(cls, values: Mapping[str, Any]) -> ModelSpec:
        """The model the keywords describe; ``hf_config_file`` read (``hf_config`` over it), and the
        command line's TARGET (its text, what it names) named by its text."""
        from graphmem.job.option import field_values

        found = field_values(cls, values)
        given, path = values.get("model"), values.get("hf_config_file")
        if isinstance(given, tuple):
            found["name"] = found.get("name") or given[0]
        if path is not None:
            from graphmem.job.hf_config import load_hf_config

            found["hf_config"] = load_hf_config(path, values.get("hf_config"))
            if given is None and found.get("preset") is None:
                found["name"] = found.get("name") or _config_name(path, found["hf_config"])
        return cls(**found)

    @property
    def shown_name(self) -> str:
        """How reports name the model."""
        if self.name:
            return self.name
        target = self.target
        return str(self.preset or (target if isinstance(target, str) else
                                   getattr(target, "__qualname__", type(target).__name__)))


def _config_name(path: str, config: Mapping[str, Any] | None) -> str:
    """``LlamaForCausalLM (from conf/config.json)``: the class a config names (its first
    ``architectures``, else its ``model_type``) and where it came from; the path alone when it
    names neither."""
    architectures = (config or {}).get("architectures")
    named = architectures[0] if isinstance(architectures, list) and architectures else (config or {}).get("model_type")
    return f"{named} (from {path})" if isinstance(named, str) and named else path


def _input_texts(inputs: Any) -> tuple[str, ...]:
    """Input specs as text; an example tensor stands for its shape and dtype (never its values)."""
    from graphmem.job.spec import input_texts

    return input_texts(inputs)


def _spec_text(value: str) -> str:
    validate_inputs([value], symbolic=None)
    return str(value)


def _assumptions(value: Any) -> dict[str, str]:
    if isinstance(value, Mapping):
        return dict(value)
    from graphmem.job.spec import parse_assumption

    return dict(parse_assumption(text) for text in value or ())


def _sample(value: Any) -> Sample | None:
    from graphmem.job.sample import read_sample

    return None if value is None else read_sample(value)


@dataclass(frozen=True, slots=True)
class Inputs:
    """The example batch: its specs, its values when given, and the values assumed for reads."""

    specs: tuple[str, ...] = field(default=(), metadata=option(
        "--input", "-i", keyword="inputs", parse=_spec_text, metavar="[NAME=]DIMS[:DTYPE]", multiple=True,
        to_field=_input_texts,
        help="Example input, repeatable: 32x1000, 8x512:int64, input_ids=2x128:int64. Unnamed inputs are "
             "positional, named ones keyword arguments. Default dtype float32. max-batch / max-seq: one dimension "
             "is a capital letter to search, e.g. Bx1000 or 1xSx64."))
    """``[NAME=]DIMS[:DTYPE]`` texts; one dimension may be a capital letter (``Bx1000``), which
    only the pre-flight search accepts."""
    sample: Sample | None = field(default=None, metadata=option(
        "--sample", metavar="FILE|module:function", to_field=_sample,
        help="The example batch itself, in place of --input: a .pt file (torch.save of a tensor, a list of "
             "tensors or a dict of named ones), a .safetensors file, or module:function returning one. Its shapes "
             "and dtypes are the inputs; its values are what the model reads where sizes depend on values (graph "
             "edges, lengths, masks)."))
    """The example batch with its values (graphmem.job.sample); ``specs`` are its specs."""
    assume: Mapping[str, str] = field(default_factory=dict, metadata=option(
        "--assume", multiple=True, metavar="NAME=VALUE", to_field=_assumptions,
        help="Value of an integer input, used only where the model reads values (if mask.all(), nonzero): ones, "
             "zeros, arange, an integer, or below:N (random integers from 0 to N-1: token ids below the "
             "vocabulary, node indices). Defaults: *mask* inputs ones, position_ids arange, others zeros. "
             "nonzero=F (0 <= F <= 1): sizes that depend on values (nonzero, x[mask], unique, LLM.int8's outlier "
             "columns) keep F of their most, instead of all (an upper bound). routing=uneven|balanced: how top-k / "
             "argmax choices made from unknown values (an MoE router's) are spread; default uneven. boxes=N: "
             "ground-truth boxes per image for a torchvision detection model trained without targets; default 8. "
             "reads=N: a number the model reads from values it computed (a predicted length, a condition on "
             "activations) is taken as N; without it such a read stops the analysis. Repeatable.")
        | shown(key="assume", at_json=90, json=lambda value, facts: dict(sorted(value.items())), label="assumed",
                at_row=100, row=lambda value, facts: ", ".join(f"{k}={v}" for k, v in sorted(value.items()))))
    """Input name -> value (``ones``, ``zeros``, ``arange`` or an integer) for the reads of
    input-derived values."""

    @classmethod
    def fold(cls, values: Mapping[str, Any]) -> Inputs:
        specs, sample = values.get("inputs", ()), values.get("sample")
        if sample is not None and specs and hasattr(sample, "specs"):  # a sample read, given other shapes
            return cls(specs=_input_texts(specs), sample=sample, assume=_assumptions(values.get("assume")))
        if sample is not None and specs:
            raise UserInputError(f"{flag(cls, 'sample')} and {flag(cls, 'specs')} both given: the sample's tensors "
                                 "are the inputs (their shapes, dtypes and values); give one of them")
        read = _sample(sample)
        return cls(specs=read.specs if read is not None else _input_texts(specs), sample=read,
                   assume=_assumptions(values.get("assume")))


def allocator_setting(given: str | None) -> tuple[str, str]:
    """The allocator settings a CUDA job runs under and where they come from: ``--alloc-conf``
    when given, else the environment's ("" when neither sets any)."""
    if given is not None:
        return given, flag(CudaTarget, "alloc_conf")
    return alloc_conf_from_environment(), "the environment"


def _allocator(given: str | None, facts: Mapping[str, Any]) -> tuple[str | None, str]:
    """On the CUDA target (its section present): the settings as JSON and in the header's words."""
    if facts["section"] is None:
        return None, ""
    conf, source = allocator_setting(given)
    return conf, (f"PYTORCH_CUDA_ALLOC_CONF={conf} (from {source})" if conf
                  else "PyTorch's defaults (PYTORCH_CUDA_ALLOC_CONF unset)")


def _dtype_text(dtype: Any) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def _gpu_name(text: str) -> str:
    """``text``, once it names one GPU preset (a model sold with several memory sizes is refused)."""
    get_gpu(text)
    return text


@dataclass(frozen=True, slots=True)
class CudaTarget:
    """The CUDA target: the GPU, its attention kernels, its caching allocator's settings."""

    gpu: str = field(default=DEFAULT_GPU, metadata=option(
        "--gpu", metavar="NAME", parse=_gpu_name,
        help=f"Target this GPU ({', '.join(GPUS)}); implies --device cuda. With --device cuda alone: {DEFAULT_GPU}."))
    """A name from graphmem.cuda.gpus.GPUS."""
    sdpa: str = field(default="auto", metadata=option(
        "--sdpa", choices=SDPA_CHOICES, default="auto", show_default=True,
        help="With --device cuda: attention backend; auto is PyTorch's own choice for the GPU and dtype.")
        | shown(key="sdpa", at_json=80, json=lambda value, facts: value or "auto", label="attention", at_row=70,
                row=lambda value, facts: f"{value} kernels ({flag(CudaTarget, 'sdpa')})" if value not in (None, "auto")
                else ""))
    """The attention backend, one of SDPA_CHOICES."""
    alloc_conf: str | None = field(default=None, metadata=option(
        "--alloc-conf", metavar="TEXT",
        help="With --device cuda: PYTORCH_CUDA_ALLOC_CONF settings (default: the environment variable), "
             "e.g. expandable_segments:True.")
        | shown(key="alloc_conf", at_json=70, json=lambda value, facts: _allocator(value, facts)[0],
                label="allocator", at_row=60, row=lambda value, facts: _allocator(value, facts)[1]))
    """PYTORCH_CUDA_ALLOC_CONF; None reads the environment."""

    def __post_init__(self) -> None:
        get_gpu(self.gpu)
        if self.sdpa not in SDPA_CHOICES:
            raise UserInputError(f"unknown sdpa backend {self.sdpa!r}; expected one of: {', '.join(SDPA_CHOICES)}")
        if self.alloc_conf is not None:
            parse_alloc_conf(self.alloc_conf)


@dataclass(frozen=True, slots=True)
class Target:
    """Where the step runs: the device, and on cuda the CUDA target."""

    device: str = field(default="cpu", metadata=option(
        "--device", choices=DEVICES,
        help="Target device whose allocations are predicted (default: cuda with --gpu, else cpu). cuda: CUDA's "
             "kernel choices and the caching allocator (what torch.cuda.max_memory_allocated / _reserved will say)."))
    """``cpu`` or ``cuda``."""
    cuda: CudaTarget | None = field(default=None, metadata=section(CudaTarget))
    """The CUDA target (None on cpu)."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise UserInputError(f"unknown device {self.device!r}; expected one of: {', '.join(DEVICES)}")
        if (self.device == "cuda") != (self.cuda is not None):
            raise AssertionError(f"Target: device {self.device!r} with cuda {self.cuda!r}")

    @classmethod
    def fold(cls, values: Mapping[str, Any]) -> Target:
        """``device`` None is cuda when ``gpu`` is given, else cpu; ``gpu`` None is DEFAULT_GPU."""
        gpu = values.get("gpu")
        device = values.get("device") or ("cuda" if gpu else "cpu")
        if device != "cuda":
            if values.get("sdpa", "auto") not in SDPA_CHOICES:
                CudaTarget(sdpa=values["sdpa"])
            return cls(device=device)
        return cls(device, CudaTarget(gpu or DEFAULT_GPU, values.get("sdpa", "auto"), values.get("alloc_conf")))

    @property
    def gpu(self) -> str | None:
        """The GPU's name (None on cpu)."""
        return self.cuda.gpu if self.cuda is not None else None

    @property
    def sdpa(self) -> str:
        """The attention backend (``auto`` on cpu)."""
        return self.cuda.sdpa if self.cuda is not None else "auto"

    @property
    def alloc_conf(self) -> str | None:
        """The allocator settings given (None: the environment's; on cpu, none)."""
        return self.cuda.alloc_conf if self.cuda is not None else None

    def with_alloc_conf(self, alloc_conf: str | None) -> Target:
        """The same target under other allocator settings."""
        assert self.cuda is not None, "with_alloc_conf: a CUDA target"
        return replace(self, cuda=replace(self.cuda, alloc_conf=alloc_conf))


def _freeze(value: Any) -> tuple[str, ...]:
    from graphmem.job.finetune import parse_freeze

    return parse_freeze(value or ())


def _lora(value: Any) -> LoraSpec | None:
    from graphmem.job.finetune import parse_lora

    return None if value is None else parse_lora(value)


def _quantize(value: Any) -> str | None:
    from graphmem.job.finetune import parse_quantize_base

    return parse_quantize_base(value)


def _with_peft(lora: LoraSpec) -> LoraSpec:
    """``lora``, once peft is found installed (UserInputError naming the extra otherwise)."""
    require_peft()
    return lora


@dataclass(frozen=True, slots=True)
class Finetune:
    """Fine-tuning: some parameters frozen, or LoRA adapters (on a quantized base: QLoRA)."""

    freeze: tuple[str, ...] = field(default=(), metadata=option(
        "--freeze", multiple=True, metavar="GLOB[,GLOB]", to_field=_freeze,
        help="Fine-tuning: parameters whose names match do not train, e.g. 'model.embed_tokens.*' or "
             "'model.layers.[0-3].*' (a module's name matches all of its parameters); all-but:GLOB freezes every "
             "other one. Repeatable."))
    """Globs on parameter names (``model.layers.0.*``; ``all-but:GLOB``) whose parameters do not train."""
    lora: LoraSpec | None = field(default=None, metadata=option(
        "--lora", parse=read_lora, done=LoraSpec, then=_with_peft, metavar="r=N,alpha=A,target=M[,M]",
        to_field=_lora,
        help="Fine-tuning with peft's LoRA: adapters of rank r on the target modules train, the rest is frozen, "
             "e.g. r=16,alpha=32,target=q_proj,v_proj[,dropout=0.05] (target=all-linear: every linear layer). "
             "Needs pip install 'graphmem[lora]'."))
    """peft's LoRA adapters on the built model; only they train."""
    quantize_base: str | None = field(default=None, metadata=option(
        "--quantize-base", choices=tuple(QUANTIZED_BASES), to_field=_quantize,
        help="QLoRA, with --lora: the base model's linear layers in 4 or 8 bits, as transformers loads them with "
             "a BitsAndBytesConfig (nf4-dq: double-quantized scales; int8: LLM.int8, load_in_8bit); the compute "
             "dtype is --dtype. Needs pip install 'graphmem[qlora]'."))
    """With ``lora``, the base's linear layers quantized as bitsandbytes loads them (QLoRA)."""

    def __post_init__(self) -> None:
        if self.quantize_base is not None and self.lora is None:
            raise UserInputError(f"{flag(Finetune, 'quantize_base')} needs {flag(Finetune, 'lora')}: quantized base "
                                 "weights do not train, so QLoRA trains LoRA adapters on them (e.g. "
                                 f"{flag(Finetune, 'lora')} r=16,alpha=32,target=all-linear)")
        if self.freeze and self.lora is not None:
            raise UserInputError(f"{flag(Finetune, 'freeze')} and {flag(Finetune, 'lora')} together: LoRA already "
                                 "freezes every weight but its adapters; give one of them")

    @classmethod
    def fold(cls, values: Mapping[str, Any]) -> Finetune | None:
        found = cls(_freeze(values.get("freeze")), _lora(values.get("lora")), _quantize(values.get("quantize_base")))
        return found if found != cls() else None

    def __str__(self) -> str:
        if self.lora and self.quantize_base:
            return f"{self.lora}, base weights in {self.quantize_base}"
        return str(self.lora) if self.lora else "frozen: " + ", ".join(self.freeze)
