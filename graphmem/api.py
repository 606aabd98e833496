"""analyze(): the stages in order — load, trace, liveness, memory model — nothing else."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from graphmem.alloc_conf import AllocatorConfig, parse_alloc_conf
from graphmem.cuda import SDPA_CHOICES, CudaKernels
from graphmem.cuda_memory import model_cuda_allocator
from graphmem.errors import UserInputError
from graphmem.generate import GenerateSpec, parse_generate
from graphmem.gpus import GPU, get_gpu
from graphmem.liveness import POLICIES, compute_lifetimes
from graphmem.load import ModelSource, build_model, resolve_target
from graphmem.memory import build_mode_report
from graphmem.presets import get_preset
from graphmem.rules import Rule, rules_for
from graphmem.spec import InputSpec, parse_input_spec
from graphmem.step import StepConfig, resolve_optimizer
from graphmem.trace import trace_step
from graphmem.types import GenerateReport, MemoryReport, ModeReport, Phase

__all__ = ["analyze", "ANALYSIS_MODES", "DEVICES"]

ANALYSIS_MODES = ("both", "train", "inference")
DEVICES = ("cpu", "cuda")


def analyze(model: str | ModelSource | None, inputs: Sequence[InputSpec | str], *,
            mode: str = "both", optimizer: str = "adam", loss: str = "auto",
            device: str = "cpu", dtype: torch.dtype | None = None,
            kwargs: Mapping[str, Any] | None = None,
            rules: Mapping[torch._ops.OpOverload, Rule] | None = None,
            policy: str = "observed", optimizer_kwargs: Mapping[str, Any] | None = None,
            optimizer_impl: str = "auto", amp: str | None = None,
            checkpoint: Sequence[str] = (), grad_accum: int = 1, gpu: str = "h100-80gb",
            sdpa: str = "auto", alloc_conf: str | None = None,
            assume: Mapping[str, str] | None = None, hf_config: Mapping[str, Any] | None = None,
            preset: str | None = None, generate: str | None = None, batch: int = 1) -> MemoryReport:
    """Predict the memory of one inference call and of a training step, without running them.

    Args:
        model: ``"pkg.module:Attr"`` / ``"file.py:Attr"``, an nn.Module class, a factory
            returning an nn.Module, or an nn.Module instance (left untouched); None with
            ``preset``.
        inputs: example inputs as ``InputSpec`` or ``"[NAME=]DIMS[:DTYPE]"`` strings.
        mode: ``"both"``, ``"train"`` or ``"inference"``.
        optimizer: a name from ``graphmem.step.OPTIMIZER_CHOICES`` (every torch.optim
            optimizer, bitsandbytes 8-bit ones by formula, ``none``) or ``pkg.module:Class``.
        loss: ``auto``, ``sum``, ``mean``, ``cross_entropy`` or ``nll`` (train only).
        device: target device; ``"cpu"``: bytes as PyTorch's CPU execution allocates them;
            ``"cuda"``: CUDA's kernel choices, and the caching allocator's allocated and
            reserved peaks (``ModeReport.allocator``).
        dtype: convert the model's floating parameters and buffers (``model.to(dtype)``).
        kwargs: keyword arguments for the model class or factory.
        rules: extra per-op scratch rules, overriding the registry's for ``device``.
        policy: storage release policy, ``"observed"`` or ``"last_use"`` (see liveness).
        optimizer_kwargs: extra keyword arguments for the optimizer.
        optimizer_impl: ``auto`` (PyTorch's choice for the device), ``for-loop``,
            ``foreach`` or ``fused``.
        amp: None, ``"bf16"`` or ``"fp16"``: torch.autocast for the device around forward
            and loss; fp16 adds a torch.amp.GradScaler.
        checkpoint: module class names to run under non-reentrant activation
            checkpointing; the report then also holds the training peak without it.
        grad_accum: forward/backward micro-steps per optimizer step.
        gpu: CUDA target: a preset name from ``graphmem.gpus.GPUS``.
        sdpa: CUDA target: attention backend, ``auto`` (PyTorch's choice), ``flash``,
            ``efficient``, ``cudnn`` or ``math``.
        alloc_conf: CUDA target: a PYTORCH_CUDA_ALLOC_CONF string; None reads the
            environment variable.
        hf_config: for a transformers model class: config values (a config.json's
            contents, see graphmem.load.load_hf_config); no download ever happens.
        preset: a name from graphmem.presets.PRESETS: the transformers class and config
            of a well-known model (``model`` may then be None); its published dtype is the
            default ``dtype``.
        generate: ``"P+N"``: instead of ``mode``, inference with a KV cache: the prefill of a
            P-token prompt and the last of N decode steps (graphmem.generate); ``inputs`` may
            then be empty.
        batch: sequences generated at once, with ``generate``.
        assume: input name -> value (``ones``, ``zeros``, ``arange`` or an integer) used to
            answer reads of input-derived values (``if mask.all()``); see graphmem.values.

    Returns:
        A MemoryReport; ``inference`` / ``train`` are None when not asked for.  Sizes in bytes.

    Known limitations:
        Memory a kernel allocates internally without dispatching an op (workspaces) is not
        seen unless a rule in ``graphmem.rules`` models it (seen: the oneDNN workspace of LSTM
        training on CPU).  Values are never known: reads of input-derived values are answered
        from ``assume``; reads of anything computed from weights raise TraceError.  The CUDA
        target is modelled from PyTorch's source, not yet measured on a GPU.
    """
    step = StepConfig(optimizer=optimizer, optimizer_kwargs=dict(optimizer_kwargs or {}),
                      optimizer_impl=optimizer_impl, loss=loss, amp=amp, checkpoint=tuple(checkpoint),
                      grad_accum=grad_accum)
    if preset is not None:
        chosen = get_preset(preset)
        model = model or chosen.target
        hf_config = {**chosen.config, **(hf_config or {})}
        dtype = dtype or chosen.dtype
        if not inputs and generate is None:
            inputs = chosen.example_input.split()  # the preset's own example batch
    specs = _validate(inputs, mode, device, policy, step, allow_empty=generate is not None)
    cuda = _cuda_target(device, gpu, sdpa, alloc_conf)
    if cuda is not None:
        step = replace(step, optimizer_impl=_cuda_default_impl(step))
    if model is None:
        raise UserInputError("no model given: pass TARGET (pkg.module:Attr) or --preset NAME")
    source = resolve_target(model) if isinstance(model, str) else model
    module = build_model(source, kwargs, hf_config)
    table = rules_for(device, rules)
    modeled = {str(op) for op in table.scratch}

    def run(m: str, config: StepConfig, inputs: Sequence[InputSpec] | None = None) -> ModeReport:
        kernels = CudaKernels(cuda[0], sdpa) if cuda else None
        trace = trace_step(module, inputs or specs, mode=m, step=config, device=device, dtype=dtype,
                           rules=table, cuda=kernels, assume=assume)
        report = build_mode_report(trace, compute_lifetimes(trace, policy), modeled)
        if cuda is None or kernels is None:  # (kernels exist exactly when cuda does)
            return report
        return replace(report, allocator=model_cuda_allocator(report, *cuda),
                       sdpa_backends=dict(kernels.backends))

    if generate is not None:
        gen = parse_generate(generate, batch)
        return MemoryReport(target=_name(model, preset), device=device, inputs=(f"generate {generate} x {batch}",),
                            inference=None, train=None, gpu=cuda[0] if cuda else None,
                            generate=_generation(gen, lambda m, s: run(m, step, s)))
    inference = run("inference", step) if mode in ("inference", "both") else None
    train = run("train", step) if mode in ("train", "both") else None
    baseline = run("train", replace(step, checkpoint=())) if train and step.checkpoint else None
    return MemoryReport(target=_name(model, preset), device=device, inputs=tuple(str(s) for s in specs),
                        inference=inference, train=train, train_without_checkpoint=baseline,
                        gpu=cuda[0] if cuda else None)


def _name(model: Any, preset: str | None) -> str:
    return str(preset or (model if isinstance(model, str) else getattr(model, "__qualname__", type(model).__name__)))


def _generation(gen: GenerateSpec, run: Callable[[str, list[InputSpec]], ModeReport]) -> GenerateReport:
    """Prefill of the prompt, then the last decode step with the cache of prompt + new - 1 tokens."""
    ids = lambda n: InputSpec((gen.batch, n), torch.int64, "input_ids")
    prefill = run("prefill", [ids(gen.prompt)])
    decode = run("decode", [ids(gen.prompt + gen.new - 1), InputSpec((gen.batch, 1), torch.int64, "next_token")])
    decode_steps = [i for i, op in enumerate(decode.trace.ops) if op.phase == Phase.DECODE]
    return GenerateReport(prompt_tokens=gen.prompt, new_tokens=gen.new, batch=gen.batch,
                          prefill_peak_bytes=prefill.peak_bytes,
                          decode_peak_bytes=max(decode.timeline[i] for i in decode_steps),
                          kv_cache_bytes=decode.trace.kv_cache_bytes, prefill=prefill, decode=decode)


def _cuda_target(device: str, gpu: str, sdpa: str, alloc_conf: str | None
                 ) -> tuple[GPU, AllocatorConfig] | None:
    """The GPU preset and allocator settings of a CUDA target (None for cpu), validated."""
    if device != "cuda":
        return None
    if sdpa not in SDPA_CHOICES:
        raise UserInputError(f"unknown sdpa backend {sdpa!r}; expected one of: {', '.join(SDPA_CHOICES)}")
    text = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if alloc_conf is None else alloc_conf
    return get_gpu(gpu), parse_alloc_conf(text)


def _cuda_default_impl(step: StepConfig) -> str:
    """PyTorch's own pick for CUDA parameters: foreach where the optimizer has it."""
    if step.optimizer_impl != "auto" or step.optimizer == "none":
        return step.optimizer_impl
    cls, _ = resolve_optimizer(step.optimizer)
    return "foreach" if "foreach" in inspect.signature(cls.__init__).parameters else "auto"


def _validate(inputs: Sequence[InputSpec | str], mode: str, device: str, policy: str,
              step: StepConfig, allow_empty: bool = False) -> list[InputSpec]:
    """Check every option before anything is imported or traced."""
    step.validate()
    for value, choices, what in ((mode, ANALYSIS_MODES, "mode"), (device, DEVICES, "device"),
                                 (policy, POLICIES, "policy")):
        if value not in choices:
            raise UserInputError(f"unknown {what} {value!r}; expected one of: {', '.join(choices)}")
    if isinstance(inputs, (str, InputSpec)):
        inputs = [inputs]
    specs = [s if isinstance(s, InputSpec) else parse_input_spec(s) for s in inputs]
    if not specs and not allow_empty:
        raise UserInputError("no input given; pass at least one --input such as 32x1000")
    return specs
