"""Building a model without the meta device (stage 1, beside load): under fake tensors, else
once with real CPU tensors under a limit; either way the result is moved to the meta device.

Used by graphmem.job.load.construct_model when a constructor reads tensor values, which the
meta device cannot answer (``.item()``, ``int(t)``, ``.tolist()``, value-dependent shapes).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from graphmem._torch_api import OP_ERRORS, StorageWeakRef, module_buffers, module_parameters, storage_key
from graphmem.job.devices import cuda_calls_on_cpu
from graphmem.job.values import keep_value, kept_values

__all__ = ["TooLarge", "first_line", "on_cpu", "on_fake", "on_meta", "reads_values"]


def on_meta(build: Callable[[], Any], device: str) -> Any:
    with cuda_calls_on_cpu(device, tensors_on="meta"), torch.device("meta"), kept_values():
        return build()


def on_fake(build: Callable[[], Any], device: str) -> Any:
    # Real tensors (a module's constants) may take part: they are read only.
    from graphmem._torch_api import FakeTensorMode

    with cuda_calls_on_cpu(device, tensors_on="cpu"), FakeTensorMode(allow_non_fake_inputs=True):
        model = build()
    return _moved_to_meta(model)


def on_cpu(build: Callable[[], Any], device: str, limit: int) -> tuple[Any, int]:
    """Built with real tensors (the global random state left as it was); and the bytes created.
    TooLarge once more than ``limit`` bytes would be created."""
    counter = _CreatedBytes(limit)
    with torch.random.fork_rng(devices=[]), cuda_calls_on_cpu(device, tensors_on="cpu"), counter:
        model = build()
    return _moved_to_meta(model), counter.total


def reads_values(exc: BaseException) -> bool:
    """Whether a failure on the meta device may come from reading a tensor's value there
    (``Tensor.item() cannot be called on meta tensors``, ``Cannot copy out of meta tensor``,
    no meta kernel, ``can't convert meta device type tensor to numpy``), also as a cause."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        text = str(seen)
        if isinstance(seen, NotImplementedError) or "meta" in text.lower() or "__format__" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def first_line(exc: BaseException) -> str:
    """The error's first sentence, for a note (torch's messages on meta go on for lines)."""
    line = re.split(r"(?<=[.!])\s", (str(exc).strip().splitlines() or [type(exc).__name__])[0])[0]
    return line if len(line) <= 120 else line[:117] + "..."


def _moved_to_meta(model: Any) -> Any:
    """Each parameter, buffer and tensor attribute replaced by an empty meta tensor with its
    shape, strides and dtype, as a build on the meta device leaves them: a tensor two modules
    share stays shared, a Parameter stays a Parameter with its requires_grad."""
    if not isinstance(model, nn.Module):
        return model
    memo: dict[int, torch.Tensor] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
            keep_value(memo[id(t)], t)
        return memo[id(t)]

    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module_parameters(module), module_buffers(module))
        for table in tables:
            for key, value in table.items():
                if value is not None:
                    table[key] = meta(value)
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):
                vars(module)[key] = meta(value)
    return model


_FACTORIES = frozenset({
    torch.empty, torch.empty_strided, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn,
    torch.randint, torch.randperm, torch.arange, torch.linspace, torch.logspace, torch.eye, torch.tensor,
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones,
    torch.Tensor.new_full, torch.Tensor.new_tensor,
})


class TooLarge(BaseException):
    """The real build passed the limit (a BaseException: the model's ``except Exception`` must
    not swallow it and go on allocating)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.nbytes = nbytes


class _CreatedBytes(TorchFunctionMode):
    """Adds up the bytes of the storages torch calls create (each storage once, while it
    lives: a storage freed and a new one made at its address are two); a factory's size is
    checked on the meta device before it allocates anything."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.total = limit, 0
        self.seen: dict[int, StorageWeakRef] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        planned = self.total + (_factory_bytes(func, args, kwargs) if func in _FACTORIES else 0)
        if planned > self.limit:
            raise TooLarge(planned)
        out = func(*args, **kwargs)
        for t in _tensors(out):
            if t.is_meta or t.layout != torch.strided:
                continue
            cdata, ref, nbytes = storage_key(t)
            if cdata in self.seen and not self.seen[cdata].expired():
                continue
            self.seen[cdata] = ref
            self.total += nbytes
        if self.total > self.limit:
            raise TooLarge(self.total)
        return out


def _factory_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The bytes a factory call would allocate, from the same call on the meta device (0 if
    that cannot tell, e.g. ``torch.tensor`` of tensors: the real call is counted after)."""
    meta_args = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                 if isinstance(a, torch.Tensor) else a for a in args]
    try:
        out = func(*meta_args, **{**kwargs, "device": "meta"})
    except OP_ERRORS:  # the meta device cannot tell
        return 0
    return sum(t.untyped_storage().nbytes() for t in _tensors(out))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
