"""graphmem.trace.core.storages: a sparse tensor (no storage of its own) is its parts' storages,
released when it dies; each size by hand, on real CPU tensors."""

from __future__ import annotations

import torch

from graphmem.records import Role
from graphmem.trace.core.storages import StorageBooks

# 2 of 6 elements set
DENSE = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])


def test_a_coo_tensor_is_its_indices_and_values() -> None:
    books = StorageBooks([])
    sparse = DENSE.to_sparse()
    records = books.track_all(sparse, 0)
    assert [(r.nbytes, r.shape, r.dtype) for r in records] == [(32, (2, 2), "int64"), (8, (2,), "float32")]
    assert books.track(sparse, 0) is records[0]  # the same storages, seen again
    assert books.sid_of(sparse) == records[0].sid
    del sparse
    books.poll()
    assert [r.released for r in records] == [-1, -1]  # died before any op was recorded


def test_a_csr_tensor_is_its_row_offsets_column_indices_and_values() -> None:
    books = StorageBooks([])
    sparse = DENSE.to_sparse_csr()
    books.mark(sparse, Role.INPUT, "adjacency")
    sizes = [(s.nbytes, s.label, Role.INPUT in s.roles) for s in books.storages]
    # 3 row offsets (24 B); 2 column indices, on the 2 x 2 indices torch's conversion made (32 B); 2 values (8 B)
    assert sizes == [(24, "adjacency", True), (32, "adjacency", True), (8, "adjacency", True)]
    books.poll()
    assert all(s.released is None for s in books.storages)  # alive while the tensor is
