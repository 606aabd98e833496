"""A tensor's internals: its storage's identity and liveness, its version counter, its
view and sparse parts, how ``Tensor.to`` parses its arguments and how ``repr`` places suffixes."""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["StorageWeakRef", "all_true", "coo_parts", "is_view", "parse_to", "sparse_nnz", "storage_expired",
           "storage_id", "storage_key", "tensor_text", "version_of"]


def storage_key(t: torch.Tensor) -> tuple[int, StorageWeakRef, int]:
    """Identity, weak reference and size in bytes of the storage behind ``t``.

    Views and in-place results share their base's storage, so they share its key.
    """
    storage = t.untyped_storage()
    ref = StorageWeakRef(storage)
    return ref.cdata, ref, storage.nbytes()


# Whether the storage behind a StorageWeakRef's handle (``ref.cdata``) was freed: the C call
# that StorageWeakRef.expired makes, without its two Python frames (a hot loop).
storage_expired = torch.UntypedStorage._expired


def parse_to(*args: Any, **kwargs: Any) -> tuple[torch.device | None, torch.dtype | None, bool, Any]:
    """``Tensor.to``'s arguments as (device, dtype, non_blocking, memory_format), as torch parses
    them (``Module.to`` does the same)."""
    parsed: tuple[torch.device | None, torch.dtype | None, bool, Any] = torch._C._nn._parse_to(*args, **kwargs)
    return parsed


def tensor_text(value: torch.Tensor, suffixes: list[str]) -> str:
    """``repr(value)`` with more of ``_str_intern``'s suffixes (``grad_fn=<...>``, ``device=...``), placed
    as torch places them (torch/_tensor_str.py ``_add_suffixes``: on the line, or on a new one past
    the line width)."""
    from torch._tensor_str import _add_suffixes

    text = repr(value)
    if not suffixes:
        return text
    return str(_add_suffixes(text[:-1], suffixes, len("tensor("), False))


def storage_id(t: torch.Tensor) -> int:
    """The id of the storage behind ``t`` while that storage lives (views and in-place results
    share their base's)."""
    cdata: int = t.untyped_storage()._cdata
    return cdata


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter: autograd counts each in-place write to its storage."""
    return t._version


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor (autograd's own answer)."""
    return t._is_view()


def all_true(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of bool ``t`` is true, as a one-element tensor (the reduction
    ``torch._check_tensor_all_with`` runs)."""
    return t._is_all_true()


def sparse_nnz(t: torch.Tensor) -> Any:
    """The specified elements of sparse ``t`` (an int, or a SymInt where sizes are symbols)."""
    return t._nnz()


def coo_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices and values of COO-sparse ``t``, as stored (uncoalesced too)."""
    return t._indices(), t._values()
