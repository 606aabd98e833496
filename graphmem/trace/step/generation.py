"""Inference with a KV cache: what ``model.generate`` holds (``--generate``, job.generation.GenerateSpec).

``--generate P+N`` on a causal language model (a transformers ``*ForCausalLM``, or any
model whose forward takes ``input_ids``, ``use_cache`` and returns its cache):

1. prefill: one forward over the P-token prompt, ``use_cache=True``, keeping only the last
   position's logits (``logits_to_keep=1``, as generate does) -> the prefill peak;
2. decode with a full cache: the cache of P+N-1 tokens (built by one forward, which leaves
   the same per-layer key/value tensors as N-1 incremental steps: the model's own cache
   class concatenates into one contiguous tensor per layer), then one decode step of one
   token -> the decode peak, the peak of the last generation step; the cache then holds
   P+N tokens.

Not included: the generation loop's own per-step buffers (the previous step's logits and
the sampling scores, about batch x vocab floats).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import storage_key, tree_flatten
from graphmem.errors import UserInputError
from graphmem.job.option import spelling
from graphmem.records import Phase, Role
from graphmem.trace.step.run import StepRun

__all__ = ["cache_tensors", "decode_with_full_cache", "prefill", "run_generation"]


def _cache_keyword(model: nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise UserInputError(f"{type(model).__name__}.forward takes no past_key_values: {spelling('generate')} needs a "
                         "causal language model with a KV cache (e.g. transformers *ForCausalLM)")


def _call(model: nn.Module, ids: torch.Tensor, cache: Any = None) -> Any:
    kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1
    if cache is not None:
        kwargs[_cache_keyword(model)] = cache
    return model(**kwargs)


def _cache_of(out: Any) -> Any:
    names = ("cache", "past_key_values") if "cache" in getattr(out, "keys", lambda: ())() else ("past_key_values",)
    cache = next((getattr(out, n) for n in names if getattr(out, n, None) is not None), None)
    if cache is None:
        raise UserInputError(f"the model returned no KV cache ({type(out).__name__}.past_key_values is "
                             f"None); {spelling('generate')} needs a model that supports use_cache=True")
    return cache


def prefill(model: nn.Module, ids: torch.Tensor) -> Any:
    """The prompt's forward; returns the cache (the logits are dropped, as generate does)."""
    return _cache_of(_call(model, ids))


def decode_with_full_cache(model: nn.Module, ids_all_but_one: torch.Tensor, token: torch.Tensor,
                           mark_decode: Any) -> Any:
    """Fill the cache with P+N-1 tokens, then ``mark_decode()`` and run one decode step."""
    cache = prefill(model, ids_all_but_one)
    mark_decode()
    out = _call(model, token, cache)
    return _cache_of(out)


def cache_tensors(cache: Any) -> Iterator[torch.Tensor]:
    """Every key/value tensor a cache object holds (transformers' DynamicCache, legacy tuples)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer in layers:
            for name in ("keys", "values"):
                value = getattr(layer, name, None)
                if isinstance(value, torch.Tensor):
                    yield value
        return
    for name in ("key_cache", "value_cache"):
        yield from (t for t in getattr(cache, name, []) if isinstance(t, torch.Tensor))
    if not hasattr(cache, "key_cache"):
        yield from (t for t in tree_flatten(cache)[0] if isinstance(t, torch.Tensor))


def run_generation(run: StepRun) -> int:
    """``prefill``: the prompt's forward; ``decode``: fill the cache, then one decode step.
    Returns the bytes of the KV cache at the end (its storages, each counted once)."""
    recorder, model, kwargs = run.recorder, run.model, run.kwargs
    model.eval()
    recorder.phase = Phase.PREFILL
    with torch.no_grad(), run.autocast():
        if run.mode == "prefill":
            cache = prefill(model, kwargs["input_ids"])
        else:
            def start_decode() -> None:
                recorder.phase = Phase.DECODE
            cache = decode_with_full_cache(model, kwargs["input_ids"], kwargs["next_token"], start_decode)
    storages = {}
    for tensor in cache_tensors(cache):
        recorder.mark(tensor, Role.OUTPUT, "kv cache")
        key, _, nbytes = storage_key(tensor)
        storages[key] = nbytes
    recorder.poll()  # the cache is still referenced here: it stays live to the end
    return sum(storages.values())
