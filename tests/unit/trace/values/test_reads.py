"""graphmem.trace.values.reads: Python's reads of fake tensors' values, answered as a real tensor's,
inside a recorder set up as graphmem run sets it up (a program's code: its data keeps its real
values, any other read is 0 and noted).  Each answer is compared with the same read of a real
tensor; each byte count is by hand."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from graphmem.job.assume import Assumptions
from graphmem.records import Phase
from graphmem.trace.core.fake_mode import recording_fake_mode
from graphmem.trace.core.recorder import Recorder
from graphmem.trace.rules.registry import rules_for

NOTE = "the program read a value of a tensor, taken as 0"


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    recorder = Recorder(rules_for("cpu"), Assumptions(reads=0), held=frozenset(), read_note=NOTE,
                        where=lambda: "train.py:7")
    recorder.phase = Phase.PROGRAM
    recorder.answers.shadows.real_limit = None
    with recording_fake_mode(), recorder:
        yield recorder


def _notes(recorder: Recorder) -> list[str]:
    return recorder.answers.declared_notes()


def test_data_reads_back_as_it_is(recorder: Recorder) -> None:
    data = torch.tensor([[1.5, -2.0], [0.25, 3.0]])  # each text below is a real tensor's of these values
    assert repr(data) == "tensor([[ 1.5000, -2.0000],\n        [ 0.2500,  3.0000]])"
    assert str(data * 2) == "tensor([[ 3.0000, -4.0000],\n        [ 0.5000,  6.0000]])"
    assert f"{data.sum():.3f}" == "2.750" and f"{data[0, 0]}" == "1.5"
    assert data.tolist() == [[1.5, -2.0], [0.25, 3.0]]
    assert data.numpy().tolist() == [[1.5, -2.0], [0.25, 3.0]]
    assert np.asarray(data, dtype=np.float64).sum() == 2.75
    assert bool(torch.isfinite(data).all())
    assert _notes(recorder) == []  # nothing was taken as 0


def test_unknown_values_read_as_zero_and_noted(recorder: Recorder) -> None:
    weight = torch.nn.Parameter(torch.empty(2, 3))  # uninitialised: no values known
    recorder.answers.shadows.forget(weight)
    out = weight.sum()
    assert repr(out) == "tensor(0., grad_fn=<SumBackward0>)"
    assert repr(weight) == ("Parameter containing:\ntensor([[0., 0., 0.],\n        [0., 0., 0.]], "
                            "requires_grad=True)")
    assert f"{out:.2f}" == "0.00"
    assert weight.detach().tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert bool(torch.isfinite(out))  # a run that trains has finite values
    assert not bool(torch.isnan(out)) and not bool(weight.isinf().any())
    assert _notes(recorder) == [f"{NOTE}: train.py:7 read as 0.0", f"{NOTE}: train.py:7 read as 0.0 everywhere",
                                "the program checked values graphmem does not know for NaN or inf, taken as finite: "
                                "train.py:7"]


def test_what_torch_refuses_is_refused(recorder: Recorder) -> None:
    weight = torch.nn.Parameter(torch.empty(3))
    with pytest.raises(RuntimeError, match="Can't call numpy\\(\\) on Tensor that requires grad"):
        weight.numpy()
    with pytest.raises(TypeError, match="unsupported format string"):
        format(torch.tensor([1.0, 2.0]), ".2f")  # a spec on more than one element: torch refuses it
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(weight * 2)


def test_a_deep_copy_copies_the_whole_storage(recorder: Recorder) -> None:
    """torch/_tensor.py ``__deepcopy__``: a copy of the storage (all of it, for a view), then a
    one-element tensor (``new_empty([])``) set to it; its values are its own."""
    table = torch.arange(8, dtype=torch.float32)
    before = len(recorder.books.storages)
    part = copy.deepcopy(table[2:4])
    made = recorder.books.storages[before:]
    assert [s.nbytes for s in made] == [32, 4]  # the 8 float32 of the storage; new_empty's one float32
    assert part.tolist() == [2.0, 3.0] and part.storage_offset() == 2
    part += 1
    assert part.tolist() == [3.0, 4.0] and table[2:4].tolist() == [2.0, 3.0]
    assert copy.deepcopy(torch.tensor(0.0)).item() == 0.0  # torchmetrics' add_state default
