"""Fake tensors for stage 2 (trace): a model's parameters and buffers, and the example inputs.

Input: a module (on meta, or a user's instance with real weights) and input specs.  Output:
fake tensors on the target device, backed by meta storage, so the real step can run with no
memory behind it.  The user's module gets its own tensors back when the context exits.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import FakeTensorMode, module_buffers, module_parameters, storage_id, to_fake
from graphmem.job.spec import InputSpec
from graphmem.job.values import built_value
from graphmem.records import Role

__all__ = ["fake_inputs", "fake_parameters", "fake_copy"]


def fake_inputs(inputs: Sequence[InputSpec], mode: FakeTensorMode, device: torch.device,
                symbol: torch.SymInt | None = None) -> tuple[list[Any], dict[str, Any]]:
    """Fake example inputs: unnamed ones positional, named ones keyword arguments.  With a
    ``symbol``, each spec's ``symbolic`` dimensions are that size symbol."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for spec in inputs:
        if symbol is not None and spec.symbolic:
            with mode:
                shape = [symbol if i in spec.symbolic else d for i, d in enumerate(spec.shape)]
                fake = torch.empty(shape, dtype=spec.dtype, device=device)
        else:
            fake = to_fake(mode, torch.empty(spec.shape, dtype=spec.dtype, device="meta"), device)
        if spec.name:
            kwargs[spec.name] = fake
        else:
            args.append(fake)
    return args, kwargs


@contextlib.contextmanager
def fake_parameters(model: nn.Module, mode: FakeTensorMode, device: torch.device,
                  dtype: torch.dtype | None) -> Iterator[tuple[dict[torch.Tensor, tuple[str, Role]],
                                                               dict[torch.Tensor, torch.Tensor]]]:
    """Swap every parameter and buffer for a fake one (tied tensors stay tied); restore after.

    Yields fake tensor -> (qualified name, role), parameters first; and fake buffer -> its
    real value, for the buffers whose values are known (graphmem.job.values).
    """
    values: dict[torch.Tensor, torch.Tensor] = {}
    originals: list[tuple[dict[str, Any], str, Any]] = []
    memo: dict[int, torch.Tensor] = {}
    names: dict[torch.Tensor, tuple[str, Role]] = {}
    try:
        for prefix, module in model.named_modules():  # once each, a module shared between parents too
            tables: tuple[tuple[dict[str, Any], Role], ...] = (
                (module_parameters(module), Role.PARAMETER), (module_buffers(module), Role.BUFFER))
            for table, role in tables:
                for key, value in list(table.items()):
                    if value is None:
                        continue
                    if id(value) not in memo:
                        memo[id(value)] = fake_copy(value, mode, device, dtype)
                        name = f"{prefix}.{key}" if prefix else key
                        names[memo[id(value)]] = (name, role)
                        known = built_value(value) if role == Role.BUFFER else None
                        if known is not None:
                            values[memo[id(value)]] = _in_dtype(known, dtype)
                        for attribute, tensor in _carry_state(value, memo[id(value)], mode, device, memo):
                            names[tensor] = (f"{name}.{attribute}", role)
                    originals.append((table, key, value))
                    table[key] = memo[id(value)]
        yield dict(sorted(names.items(), key=lambda kv: kv[1][1] != Role.PARAMETER)), values
    finally:
        for table, key, value in reversed(originals):
            table[key] = value


def _carry_state(value: torch.Tensor, fake: torch.Tensor, mode: FakeTensorMode, device: torch.device,
                 memo: dict[int, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """A quantized weight (bitsandbytes' Params4bit, Int8Params) keeps its quantization state
    in Python attributes: a QuantState of tensors (scales, code book, nested state), or the
    int8 weight itself (``CB``, the weight's own storage) and its scales (``SCB``).  The fake
    weight gets the same attributes, each tensor in them a fake copy (shared ones stay shared;
    one on the weight's own storage is the fake weight).

    Returns (attribute path, fake tensor) for each tensor copied: they are held like the weight.
    """
    if type(value) in (torch.Tensor, nn.Parameter) or not vars(value):
        return []
    copied: list[tuple[str, torch.Tensor]] = []

    def fake_of(item: Any, path: str, depth: int) -> Any:
        if isinstance(item, torch.Tensor):
            if storage_id(item) == storage_id(value):
                return fake
            if id(item) not in memo:
                memo[id(item)] = fake_copy(item, mode, device, None)
                copied.append((path, memo[id(item)]))
            return memo[id(item)]
        if depth < 3 and hasattr(item, "__dict__") and not isinstance(item, (nn.Module, type)) and any(
                isinstance(v, torch.Tensor) or hasattr(v, "__dict__") for v in vars(item).values()):
            twin = copy.copy(item)
            for k, v in vars(item).items():
                setattr(twin, k, fake_of(v, f"{path}.{k}", depth + 1))
            return twin
        return item

    for attribute, item in vars(value).items():
        setattr(fake, attribute, fake_of(item, attribute, 0))
    return copied


def fake_copy(t: torch.Tensor, mode: FakeTensorMode, device: torch.device,
              dtype: torch.dtype | None) -> torch.Tensor:
    meta = _in_dtype(t if t.is_meta else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"),
                     dtype)
    fake = to_fake(mode, meta.detach(), device)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake


def _in_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` converted as ``model.to(dtype)`` converts it: floating and complex tensors only."""
    return t.to(dtype) if dtype is not None and (t.is_floating_point() or t.is_complex()) else t
