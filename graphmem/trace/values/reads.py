"""Python's reads of a tensor's values while a program is recorded (graphmem run).  Stage 2 (trace).

Input: the recording's ``ValueAnswers``.  Output: ``reading_values``, a context manager inside
which a fake tensor answers the ways Python reads a tensor's values that no op of the recorder's
answers, as a real tensor answers them (torch/_tensor.py, torch 2.13):

- ``format(t, spec)`` (``f"{loss:.4f}"``): a one-element tensor formats its ``.item()``; any other,
  or a spec on one that is not (a Parameter, a meta tensor), as ``object`` does (torch refuses a spec).
- ``repr``, ``str``, ``print``: torch's text of the values, with the autograd and device suffixes
  of the fake tensor itself (``grad_fn=<MeanBackward0>``, ``device='cuda:0'``).
- ``tolist()``, ``numpy()`` and so ``np.asarray`` (``__array__`` calls ``numpy()``): the values;
  ``numpy()`` refuses a tensor that requires grad or is not on the CPU, as torch does.
- ``copy.deepcopy``: a copy of the whole storage, made as torch makes it (its bytes, then the
  one-element tensor ``new_empty`` makes, set to them), so its memory is the real run's; its
  values are a copy of the known ones.  (torch's own path fails on some fakes: it copies the
  storage, a meta one, into a CPU tensor.)
- ``torch.isfinite(x)``, no single op (its ``abs``, ``ne``, ``eq``, ``mul`` run): on values graphmem
  does not know, true everywhere, as ``isnan`` / ``isinf`` answer false
  (graphmem.trace.values.shadows: a run that trains has no NaN).

The values are ``ValueAnswers.values_of``'s: the real ones where graphmem knows them (the
program's data), else the stated value, noted with the program's line.  ``item()``, ``float``,
``int``, ``bool``, ``__index__``, comparisons in conditions, ``math.*`` and iteration need nothing
here: each reads through ``_local_scalar_dense``, which the recorder answers the same way.
Knows nothing of the program runner; real tensors are left as they are.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn

from graphmem._torch_api import FakeTensor, outside_modes, tensor_text
from graphmem.patching import patched
from graphmem.trace.values.answers import ValueAnswers

__all__ = ["reading_values"]

# devices whose tensors torch deep-copies with clone() (torch/_tensor.py __deepcopy__)
_CLONED_ON = frozenset({"lazy", "xla", "mtia", "mps", "maia", "meta", "ipu"})


class _Reads:
    """The patched methods, each answering from ``answers``; ``originals`` are torch's own."""

    def __init__(self, answers: ValueAnswers) -> None:
        self.answers = answers
        self.repr: Any = torch.Tensor.__repr__
        self.tolist: Any = FakeTensor.tolist
        self.numpy: Any = torch.Tensor.numpy
        self.deepcopy: Any = torch.Tensor.__deepcopy__
        self.isfinite: Any = torch.isfinite

    def format_(self, t: torch.Tensor, spec: str) -> str:
        if t.dim() == 0 and not t.is_meta and not isinstance(t, nn.Parameter):
            return format(t.detach().item(), spec)  # the read is the recorder's: answered and noted there
        return object.__format__(t, spec)

    def repr_(self, t: torch.Tensor, *, tensor_contents: Any = None) -> str:
        value = None if t.is_meta or tensor_contents is not None else self.answers.values_of(t)
        if value is None:
            return self.repr(t, tensor_contents=tensor_contents)  # type: ignore[no-any-return]
        suffixes = [f"device='{t.device}'"] if t.device.type != torch.get_default_device().type else []
        if t.grad_fn is not None:
            name = type(t.grad_fn).__name__
            suffixes.append(f"grad_fn=<{t.grad_fn.name().rsplit('::', 1)[-1] if name == 'CppFunction' else name}>")
        elif t.requires_grad:
            suffixes.append("requires_grad=True")
        with outside_modes():
            text = tensor_text(value.detach(), suffixes)
        return f"Parameter containing:\n{text}" if isinstance(t, nn.Parameter) else text

    def tolist_(self, t: torch.Tensor) -> Any:
        value = None if t.is_meta else self.answers.values_of(t)
        if value is None:
            return self.tolist(t)
        with outside_modes():
            return value.tolist()

    def numpy_(self, t: torch.Tensor, *, force: bool = False) -> Any:
        if not force and t.device.type != "cpu":
            raise TypeError(f"can't convert {t.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        if not force and t.requires_grad:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        value = self.answers.values_of(t)
        if value is None:
            return self.numpy(t, force=force)
        with outside_modes():
            return value.detach().numpy(force=force)

    def deepcopy_(self, t: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
        if not t.is_leaf or id(t) in memo or t.is_sparse or t.device.type in _CLONED_ON or t.is_quantized:
            return self.deepcopy(t, memo)  # type: ignore[no-any-return]  # torch's own: a refusal, or clone()
        with torch.no_grad():  # torch/_tensor.py __deepcopy__: the storage copied, then a tensor set to it
            storage = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8, device=t.device)
            new = t.new_empty([])
            new.set_(storage.untyped_storage(), t.storage_offset(), t.size(), t.stride())
            if t.is_conj():
                new = new.conj_physical()
            if t.is_neg():
                new = new.neg()
        self.answers.shadows.copied(new, t)
        if t.requires_grad:
            new.requires_grad_()
        if t.grad is not None:
            new.grad = copy.deepcopy(t.grad, memo)
        own = vars(new)
        for name, value in list(vars(t).items()):  # the program's own attributes (FakeTensor's are new's own)
            if name not in own:
                setattr(new, name, copy.deepcopy(value, memo))
        memo[id(t)] = new
        return new

    def isfinite_(self, x: Any) -> Any:
        out = self.isfinite(x)
        if isinstance(x, FakeTensor) and isinstance(out, FakeTensor) and self.answers.shadows.get(x) is None:
            self.answers.shadows.finite_check(out, True)
        return out


def reading_values(answers: ValueAnswers) -> contextlib.AbstractContextManager[None]:
    """Inside, fake tensors answer Python's reads of their values from ``answers`` (see the
    module's docstring); on exit, torch's own methods are back."""
    reads = _Reads(answers)

    def format_(t: torch.Tensor, spec: str) -> str:
        return reads.format_(t, spec)

    def repr_(t: torch.Tensor, *, tensor_contents: Any = None) -> str:
        return reads.repr_(t, tensor_contents=tensor_contents)

    def tolist(t: torch.Tensor) -> Any:
        return reads.tolist_(t)

    def numpy(t: torch.Tensor, *, force: bool = False) -> Any:
        return reads.numpy_(t, force=force)

    def deepcopy(t: torch.Tensor, memo: dict[int, Any]) -> torch.Tensor:
        return reads.deepcopy_(t, memo)

    def isfinite(x: Any) -> Any:  # a function: as Tensor.isfinite it is bound to the tensor
        return reads.isfinite_(x)

    return patched((FakeTensor, "__format__", format_), (FakeTensor, "__repr__", repr_), (FakeTensor, "tolist", tolist),
                   (FakeTensor, "numpy", numpy), (FakeTensor, "__deepcopy__", deepcopy),
                   (torch, "isfinite", isfinite), (torch.Tensor, "isfinite", isfinite))
