"""Sparse tensors in a recording: their memory, and how many elements a conversion keeps.

Used by stage 2 (trace).  Input: a (fake) tensor in a sparse layout, or an op that converts to
one.  Output: the tensors whose storages hold a sparse tensor's memory (``parts``: COO's indices
and values; CSR's, CSC's, BSR's and BSC's compressed indices, plain indices and values: a sparse
tensor has no storage of its own), and the meta tensor a conversion's result is rebuilt from
with the number of elements the real kernel keeps (``with_elements``).

A conversion to a sparse layout (``to_sparse``, ``to_sparse_csr``, ...) keeps the elements that
are not zero: how many depends on values, and the fake kernels keep none (an empty sparse
tensor).  ``most_elements`` is the most it can keep.  Knows nothing of the recorder or shadows.
"""

from __future__ import annotations

import math

import torch

from graphmem._torch_api import coo_parts, hint_of, outside_modes, sparse_nnz

__all__ = ["SPARSE_CONVERSIONS", "is_sparse", "most_elements", "parts", "with_elements"]

_aten = torch.ops.aten
# the ops a conversion to a sparse layout dispatches (Tensor.to_sparse* call these)
SPARSE_CONVERSIONS = frozenset(getattr(packet, overload) for packet in (
    _aten._to_sparse, _aten._to_sparse_csr, _aten._to_sparse_csc, _aten._to_sparse_bsr, _aten._to_sparse_bsc)
    for overload in packet.overloads())
_COMPRESSED_ROWS = (torch.sparse_csr, torch.sparse_bsr)  # compressed along rows (crow_indices)
_COMPRESSED = frozenset({*_COMPRESSED_ROWS, torch.sparse_csc, torch.sparse_bsc})


def is_sparse(t: torch.Tensor) -> bool:
    """Whether ``t`` is in a sparse layout (COO or compressed)."""
    return t.layout is torch.sparse_coo or t.layout in _COMPRESSED


def parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors holding sparse ``t``'s memory (aliases of its own, which share their storages),
    taken with no dispatch mode active: asking is no op of the program's."""
    with outside_modes():
        if t.layout is torch.sparse_coo:
            return coo_parts(t)
        if t.layout in _COMPRESSED_ROWS:
            return t.crow_indices(), t.col_indices(), t.values()
        return t.ccol_indices(), t.row_indices(), t.values()


def most_elements(source: torch.Tensor, out: torch.Tensor) -> int:
    """The most specified elements (``nnz``) ``out``, converted from ``source``, can have: those of
    a sparse ``source``; else one for each position of its sparse dimensions (blocks for BSR and
    BSC), every element not zero."""
    if is_sparse(source):
        return hint_of(sparse_nnz(source))
    if out.layout is torch.sparse_coo:
        return math.prod(hint_of(d) for d in out.shape[:out.sparse_dim()])
    compressed, _, values = parts(out)
    batch = compressed.dim() - 1
    block = values.shape[batch + 1:values.dim() - out.dense_dim()]  # BSR / BSC: each element is a block
    rows, columns = (hint_of(d) for d in out.shape[batch:batch + 2])
    return (rows * columns) // math.prod(hint_of(d) for d in block)


def with_elements(t: torch.Tensor, nnz: int, source: torch.Tensor) -> torch.Tensor:
    """A meta tensor in ``t``'s sparse layout, shape and dtypes with ``nnz`` specified elements
    (per batch, for a batched compressed layout), as converted from ``source``: from a dense or
    COO tensor to a compressed layout, the plain indices are the second row of the COO indices
    the conversion goes through, on their storage of 2 x nnz indices (so torch 2.13's CPU
    kernels leave them: ``col_indices()`` at storage offset nnz)."""
    meta = torch.device("meta")
    pieces = parts(t)
    if t.layout is torch.sparse_coo:
        indices, values = pieces
        return torch.sparse_coo_tensor(torch.empty((indices.shape[0], nnz), dtype=indices.dtype, device=meta),
                                       torch.empty((nnz, *values.shape[1:]), dtype=values.dtype, device=meta),
                                       t.shape, is_coalesced=True, check_invariants=False)
    compressed, plain, values = pieces
    batch = tuple(compressed.shape[:-1])
    if batch or (is_sparse(source) and source.layout is not torch.sparse_coo):
        plain_indices = torch.empty((*batch, nnz), dtype=plain.dtype, device=meta)
    else:
        plain_indices = torch.empty((2, nnz), dtype=plain.dtype, device=meta)[1]
    return torch.sparse_compressed_tensor(
        torch.empty(compressed.shape, dtype=compressed.dtype, device=meta), plain_indices,
        torch.empty((*batch, nnz, *values.shape[len(batch) + 1:]), dtype=values.dtype, device=meta),
        t.shape, layout=t.layout, check_invariants=False)
