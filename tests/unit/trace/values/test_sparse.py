"""graphmem.trace.values.sparse: a sparse tensor's parts, the most elements a conversion keeps, and
the meta stand-in with a given number of elements; on real CPU tensors, each size by hand."""

from __future__ import annotations

import pytest
import torch

from graphmem.trace.values.sparse import SPARSE_CONVERSIONS, is_sparse, most_elements, parts, with_elements

# 3 of 12 elements set: (0, 1), (1, 3), (2, 0)
DENSE = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0]])


def test_parts_are_indices_and_values() -> None:
    indices, values = parts(DENSE.to_sparse())
    assert indices.tolist() == [[0, 1, 2], [1, 3, 0]] and values.tolist() == [1.0, 2.0, 3.0]
    crow, col, values = parts(DENSE.to_sparse_csr())
    assert crow.tolist() == [0, 1, 2, 3] and col.tolist() == [1, 3, 0] and values.tolist() == [1.0, 2.0, 3.0]
    ccol, row, _ = parts(DENSE.to_sparse_csc())
    assert ccol.tolist() == [0, 1, 2, 2, 3] and row.tolist() == [2, 0, 1]
    assert is_sparse(DENSE.to_sparse_bsr((1, 2))) and not is_sparse(DENSE)


def test_the_most_a_conversion_keeps() -> None:
    assert most_elements(DENSE, DENSE.to_sparse()) == 12  # every element of the 3 x 4
    assert most_elements(DENSE, DENSE.to_sparse(1)) == 3  # one per row: the rows are the sparse dimension
    assert most_elements(DENSE, DENSE.to_sparse_csr()) == 12
    assert most_elements(DENSE, DENSE.to_sparse_bsr((1, 2))) == 6  # 3 x 4 in blocks of 1 x 2
    assert most_elements(DENSE.to_sparse(), DENSE.to_sparse_csr()) == 3  # a sparse source's own elements


@pytest.mark.parametrize("layout", ["coo", "csr", "csc", "bsr"])
def test_a_stand_in_with_more_elements(layout: str) -> None:
    """The stand-in has the real tensor's layout, shape and dtypes, and ``nnz`` elements; from a
    dense tensor, the plain indices of a compressed layout sit on a storage of 2 x nnz, as the
    real conversion's do (checked against it, with nnz the real one)."""
    convert = {"coo": lambda t: t.to_sparse(), "csr": lambda t: t.to_sparse_csr(),
               "csc": lambda t: t.to_sparse_csc(), "bsr": lambda t: t.to_sparse_bsr((1, 2))}[layout]
    real = convert(DENSE)
    same = with_elements(real, real._nnz(), DENSE)
    assert same.is_meta and same.layout == real.layout and same.shape == real.shape and same._nnz() == real._nnz()
    for mine, theirs in zip(parts(same), parts(real), strict=True):
        assert (mine.shape, mine.dtype, mine.storage_offset()) == (theirs.shape, theirs.dtype, theirs.storage_offset())
        assert mine.untyped_storage().nbytes() == theirs.untyped_storage().nbytes()
    bigger = with_elements(real, 10, DENSE)
    assert bigger._nnz() == 10
    if layout == "coo":  # indices 2 x 10 int64 (160 B), values 10 float32 (40 B)
        assert [p.untyped_storage().nbytes() for p in parts(bigger)] == [160, 40]
    elif layout == "bsr":  # 4 row offsets (32 B); 10 column indices on 2 x 10 (160 B); 10 blocks of 1 x 2 (80 B)
        assert [p.untyped_storage().nbytes() for p in parts(bigger)] == [32, 160, 80]


def test_a_compressed_source_leaves_plain_indices_on_their_own_storage() -> None:
    csr = DENSE.to_sparse_csr()
    csc = with_elements(DENSE.to_sparse_csc(), 3, csr)
    assert parts(csc)[1].untyped_storage().nbytes() == 24  # 3 int64, not 2 x 3


def test_the_conversions() -> None:
    aten = torch.ops.aten
    assert {aten._to_sparse.default, aten._to_sparse.sparse_dim, aten._to_sparse_csr.default,
            aten._to_sparse_bsc.default} <= SPARSE_CONVERSIONS
    assert aten._to_dense.default not in SPARSE_CONVERSIONS


class _Densified(torch.nn.Module):
    """A model that makes its input sparse and dense again (values the analysis does not know)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.to_sparse().to_dense())


def test_analyze_keeps_the_most_a_conversion_can(monkeypatch: pytest.MonkeyPatch) -> None:
    """analyze, whose inputs have no values: the conversion keeps every element (2 x 4: 8, with
    2 x 8 int64 indices and 8 float32 values), noted as an upper bound; a random input has no zero,
    so the real run (tests/oracles.py, a sparse tensor counted by its parts) keeps as many."""
    import graphmem
    import tests.oracles as oracles
    from tests.oracles import OPTIMIZERS, measure_training

    report = graphmem.analyze(_Densified, ["2x4"], optimizer="adam", loss="sum")
    assert report.train is not None
    assert any("upper bound: to_sparse depends on values; recorded keeping 8 elements" in note
               for note in report.train.assumptions), report.train.assumptions

    class SparseParts(oracles.LiveStorages):  # type: ignore[misc]
        def add(self, t: object) -> None:  # (torch's own accessors, not graphmem's parts)
            coo = isinstance(t, torch.Tensor) and t.layout is torch.sparse_coo
            for piece in (t._indices(), t._values()) if coo else (t,):  # type: ignore[union-attr]
                super().add(piece)

    monkeypatch.setattr(oracles, "LiveStorages", SparseParts)
    real = measure_training(_Densified, [torch.randn(2, 4)], OPTIMIZERS["adam"], "sum")
    assert report.train.peak_bytes == real.peak_bytes
