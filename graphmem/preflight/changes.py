"""A plan row's changes as data: their name in words, their kind, and which ones combine.

Input: a mapping of changes (``{"optimizer": "sgd", "checkpoint": ["Block"]}``) and the job's
own optimizer.  Output: the row's name (every row, alone or combined, is named here from its
changes, so a combination reads as what it is: "fused AdamW + checkpoint every Block", never
one optimizer's implementation "+" another optimizer), the kind a combination draws one of,
and the merge of two rows' changes (None when they do not go together).  Pure.

The kinds of change (``changes`` keys):
  optimizer_impl  fused / foreach implementation of the job's own optimizer
  optimizer       another optimizer (its default implementation)
  amp             autocast ("bf16", "fp16")
  master_weights  bf16 weights, fp32 master weights and optimizer state ("bfloat16")
  dtype           weights in that dtype (training: optimizer state too)
  batch, grad_accum          the batch per step, micro-steps per optimizer step
  checkpoint, checkpoint_every, checkpoint_save   activation checkpointing
  parallel        "zero1=8", "fsdp=8" or "fsdp=8:keep" (FSDP2 without resharding after forward)
  offload         "optimizer": the optimizer step and its state on the host
  prune_amount, prune_remove, shrink, quantize, sparse, kv_cache   (weights, cache)
  quantize_base   a LoRA job's frozen base in 4 bits (QLoRA): "nf4"
  alloc_conf      the CUDA caching allocator's PYTORCH_CUDA_ALLOC_CONF, with expandable segments
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["COMBINED_KINDS", "describe", "kind_of", "merge", "optimizer_name"]

# what a combination draws one row of, by kind
COMBINED_KINDS: dict[str, tuple[str, ...]] = {
    "implementation": ("optimizer_impl",), "checkpointing": ("checkpoint",), "accumulation": ("grad_accum",),
    "precision": ("amp", "master_weights", "dtype"), "optimizer": ("optimizer",), "offload": ("offload",),
    "quantized base": ("quantize_base",), "allocator": ("alloc_conf",),
}

_NAMES = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "sgd-momentum": "SGD with momentum",
          "sgd-nesterov": "SGD with Nesterov momentum", "adagrad": "Adagrad", "rmsprop": "RMSprop",
          "adam8bit": "8-bit Adam", "adamw8bit": "8-bit AdamW", "sgd8bit-momentum": "8-bit SGD with momentum"}
# another optimizer, as its row says it
_OTHER_OPTIMIZERS = {"sgd": "SGD (no optimizer state)", "sgd-momentum": "SGD with momentum (1 state)",
                     "adamw": "AdamW (2 states)", "adam8bit": "8-bit Adam (bitsandbytes)",
                     "adamw8bit": "8-bit AdamW (bitsandbytes)",
                     "sgd8bit-momentum": "8-bit SGD with momentum (bitsandbytes)"}
_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float8": "fp8", "int8": "int8"}


def optimizer_name(name: str) -> str:
    """How people write the optimizer ``name`` ("adamw" -> "AdamW")."""
    return _NAMES.get(name, name)


def kind_of(changes: Mapping[str, Any]) -> str | None:
    """The combinable kind of a single remedy's changes (None: not combined)."""
    return next((kind for kind, keys in COMBINED_KINDS.items() if set(keys) & set(changes)), None)


def merge(first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any] | None:
    """Both rows' changes at once, or None when they do not combine.

    Another optimizer replaces the implementation of the job's own (the plan offers fused and
    foreach kernels of the optimizer the job names); offload runs the step on the host, so no
    device implementation applies and only the job's optimizer (or its master weights) moves
    there; bitsandbytes' 8-bit optimizers run on the device and keep no fp32 master copy.
    """
    merged = {**first, **second}
    optimizer = str(merged.get("optimizer", ""))
    if "offload" in merged and optimizer:
        return None
    if "master_weights" in merged and "8bit" in optimizer:
        return None
    if "optimizer_impl" in merged and ("optimizer" in merged or "offload" in merged):
        del merged["optimizer_impl"]
    return merged


def describe(changes: Mapping[str, Any], optimizer: str, mode: str = "train", device: str = "cuda") -> str:
    """The row's name: each change in words, joined with " + " in a fixed order.

    Args:
        optimizer: the job's own optimizer.
        mode: "train" or "inference".
        device: the target device: sharding is over GPUs on cuda, over processes on cpu.
    """
    parts = [words(changes, optimizer, mode) for words in _PARTS]
    if device != "cuda":
        parts = [p.replace(" GPUs", " processes") for p in parts]
    return " + ".join(p for p in parts if p)


def _optimizer_words(changes: Mapping[str, Any], optimizer: str, mode: str) -> str:
    impl = changes.get("optimizer_impl")
    if "optimizer" in changes:
        return _OTHER_OPTIMIZERS.get(changes["optimizer"], optimizer_name(changes["optimizer"]))
    return f"{impl} {optimizer_name(optimizer)} ({impl}=True)" if impl else ""


def _precision_words(changes: Mapping[str, Any], optimizer: str, mode: str) -> str:
    if "master_weights" in changes:
        return f"{_SHORT[changes['master_weights']]} weights + fp32 master weights and optimizer state"
    if "dtype" in changes:
        dtype = changes["dtype"]
        if mode == "train":
            return f"{_SHORT[dtype]} weights and optimizer state (no fp32 copy)"
        return f"{dtype} weights (model.to({dtype}))"
    amp = changes.get("amp")
    if amp is None:
        return ""
    return f"{amp} autocast" + (" + GradScaler" if amp == "fp16" and mode == "train" else "")


def _batch_words(changes: Mapping[str, Any], optimizer: str, mode: str) -> str:
    if "grad_accum" in changes:
        return f"batch {changes['batch']} x {changes['grad_accum']} accumulation steps"
    return f"batch {changes['batch']}" if "batch" in changes else ""


def _checkpoint_words(changes: Mapping[str, Any], optimizer: str, mode: str) -> str:
    if "checkpoint" not in changes:
        return ""
    classes = ", ".join(changes["checkpoint"])
    every = "2nd " if changes.get("checkpoint_every") == 2 else ""
    text = f"checkpoint every {every}{classes}"
    return text + (", keeping matmul outputs" if changes.get("checkpoint_save") else "")


def _parallel_words(changes: Mapping[str, Any], optimizer: str, mode: str) -> str:
    if "parallel" not in changes:
        return ""
    spec, _, keep = str(changes["parallel"]).partition(":")
    kind, _, n = spec.partition("=")
    if kind == "zero1":
        return f"ZeRO-1 over {n} GPUs (DDP + ZeroRedundancyOptimizer)"
    if keep:
        return f"FSDP2 over {n} GPUs, parameters kept after forward (ZeRO-2-like)"
    return f"FSDP2 over {n} GPUs (ZeRO-3)"


def _offload_words(changes: Mapping[str, Any], optimizer: str, mode: str) -> str:
    return "optimizer offloaded to the CPU (ZeRO-Offload)" if "offload" in changes else ""


def _weights_words(changes: Mapping[str, Any], optimizer: str, mode: str) -> str:
    pct = f"{changes.get('prune_amount', changes.get('shrink', 0)):.0%}"
    if "prune_remove" in changes:
        return f"prune {pct} + prune.remove"
    if "prune_amount" in changes:
        return f"prune {pct} unstructured (torch.nn.utils.prune)"
    if "shrink" in changes:
        return f"layers {pct} smaller (structured)"
    if "sparse" in changes:
        return f"prune {changes['sparse']:.0%} + CSR sparse weights"
    if "quantize" in changes:
        return f"{changes['quantize']} weight-only quantization (Linear)"
    if "quantize_base" in changes:
        kind = changes["quantize_base"]
        return f"QLoRA: the frozen base in {kind} (bitsandbytes {'8-bit' if kind == 'int8' else '4-bit'})"
    if "kv_cache" in changes:
        return f"KV cache in {_SHORT[changes['kv_cache']]}"
    return ""


def _allocator_words(changes: Mapping[str, Any], optimizer: str, mode: str) -> str:
    if "alloc_conf" not in changes:
        return ""
    conf = changes["alloc_conf"]  # the job's other allocator settings kept beside it: named
    return "expandable segments" + (f" (PYTORCH_CUDA_ALLOC_CONF={conf})" if conf != "expandable_segments:True" else "")


_PARTS: tuple[Callable[[Mapping[str, Any], str, str], str], ...] = (
    _optimizer_words, _precision_words, _batch_words, _checkpoint_words, _parallel_words, _offload_words,
    _weights_words, _allocator_words)
