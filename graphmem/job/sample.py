"""``--sample``: the example batch itself, with its real values.

Input: a ``.pt`` file (``torch.save`` of a tensor, a list or tuple of tensors, or a dict of
named tensors), a ``.safetensors`` file (named tensors), ``module:function`` returning one of
those, or the tensors themselves (the Python API).  Output: a ``Sample``: the inputs' specs
(shapes and dtypes: what ``--input`` would say) and their values, which the recording follows
where the model reads values (sizes that depend on them: graph edges, lengths, masks) instead
of values graphmem would have to invent.  Nothing but the sample's own tensors is loaded.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphmem.errors import UserInputError
from graphmem.job.option import spelling
from graphmem.job.spec import DTYPE_ALIASES, InputSpec

__all__ = ["Sample", "read_sample"]

_HINT = ("expected a .pt file (torch.save of a tensor, a list of tensors or a dict of named tensors), a "
         ".safetensors file, or module:function returning one of those")


@dataclass(frozen=True, slots=True, eq=False)
class Sample:
    """The example batch: ``specs`` as ``--input`` writes them, ``values`` by the name the
    recording gives each input (its keyword, or ``input_N`` for the N-th positional one)."""

    source: str
    specs: tuple[str, ...]
    values: tuple[tuple[str, torch.Tensor], ...]

    @property
    def by_name(self) -> dict[str, torch.Tensor]:
        return dict(self.values)


def read_sample(sample: str | Sample | torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]
                ) -> Sample:
    """The ``Sample`` of a file, ``module:function``, or tensors given in Python.

    Raises:
        UserInputError: no such file, a file or function that gives no tensors, a tensor that is
            not a dense CPU tensor of a dtype graphmem knows.
    """
    if isinstance(sample, Sample):
        return sample
    if isinstance(sample, str):
        return _from_batch(sample, _load(sample))
    return _from_batch("tensors given to analyze", sample)


def _load(text: str) -> Any:
    """What the file holds, or what ``module:function`` returns."""
    if text.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise UserInputError(f"{spelling('sample')} {text}: reading .safetensors needs safetensors: pip install "
                                 "safetensors") from exc
        _exists(text)
        return load_file(text, device="cpu")
    if os.path.exists(text) or ":" not in text:  # a file, or what was meant as one
        _exists(text)
        try:
            return torch.load(text, map_location="cpu", weights_only=True)
        except (RuntimeError, OSError, ValueError, EOFError, pickle.UnpicklingError) as exc:  # not torch.save's tensors
            said = " ".join(str(exc).split())[:200]
            raise UserInputError(f"{spelling('sample')} {text}: torch.load could not read it ({said}); "
                                 f"{_HINT}") from exc
    from graphmem.job.load import import_attribute

    found = import_attribute(text, f"{spelling('sample')}", _HINT)
    if not callable(found):
        return found
    try:
        return found()
    except Exception as exc:  # broad: the user's function may raise anything; reported as theirs
        raise UserInputError(f"{spelling('sample')} {text}: the function raised {type(exc).__name__}: {exc}") from exc


def _exists(path: str) -> None:
    if not os.path.isfile(path):
        raise UserInputError(f"{spelling('sample')} {path}: no such file; {_HINT}")


def _from_batch(source: str, batch: Any) -> Sample:
    """Specs and named values of a tensor, a sequence of tensors or a mapping of named tensors."""
    if isinstance(batch, torch.Tensor):
        batch = [batch]
    specs: list[tuple[str | None, str, Any]]  # (keyword name or None, the recording's name, value)
    if isinstance(batch, Mapping):
        specs = [(str(k), str(k), v) for k, v in batch.items()]
    elif isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        specs = [(None, f"input_{i}", v) for i, v in enumerate(batch)]
    else:
        raise UserInputError(f"{spelling('sample')} {source}: it gives a {type(batch).__name__}; {_HINT}")
    if not specs:
        raise UserInputError(f"{spelling('sample')} {source}: it holds no tensors; {_HINT}")
    return Sample(source=source, specs=tuple(str(_spec(source, name, key, v)) for name, key, v in specs),
                  values=tuple((key, v) for _, key, v in specs))


def _spec(source: str, name: str | None, key: str, value: Any) -> InputSpec:
    if not isinstance(value, torch.Tensor):
        raise UserInputError(f"{spelling('sample')} {source}: {key} is a {type(value).__name__}, not a tensor; {_HINT}")
    if value.device.type != "cpu" or value.layout != torch.strided or value.dtype not in DTYPE_ALIASES.values():
        raise UserInputError(f"{spelling('sample')} {source}: {key} is a {value.device.type} {value.layout} tensor of "
                             f"{value.dtype}; expected a dense CPU tensor of a dtype such as float32 or int64")
    return InputSpec(tuple(value.shape), value.dtype, name)
