"""The fence's named accessors read what torch's own attributes hold (a torch upgrade that moves
one fails here, by name)."""

from __future__ import annotations

import torch
from torch import nn

from graphmem._torch_api import (
    coo_parts,
    is_view,
    module_buffers,
    module_children,
    module_non_persistent_buffers,
    module_parameters,
    op_schema,
    set_module_children,
    sparse_nnz,
    storage_id,
    version_of,
)


def test_module_tables_are_the_modules_own() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model[1].register_buffer("scratch", torch.zeros(1), persistent=False)
    assert module_parameters(model[0]) is model[0]._parameters
    assert module_buffers(model[1]) is model[1]._buffers
    assert module_non_persistent_buffers(model[1]) == {"scratch"}
    children = module_children(model)
    assert children is model._modules and list(children) == ["0", "1"]
    set_module_children(model, type(children)((key, children[key]) for key in ["0"]))
    assert len(model) == 1


def test_tensor_internals() -> None:
    base = torch.zeros(4)
    view = base[1:]
    assert storage_id(view) == storage_id(base) != storage_id(torch.zeros(4))
    assert is_view(view) and not is_view(base)
    before = version_of(base)
    base.add_(1)
    assert version_of(base) == before + 1
    sparse = torch.eye(3).to_sparse()
    indices, values = coo_parts(sparse)
    assert sparse_nnz(sparse) == 3 and indices.shape == (2, 3) and values.shape == (3,)


def test_op_schema() -> None:
    schema = op_schema(torch.ops.aten.add_.Tensor)
    assert schema.is_mutable and [a.name for a in schema.arguments][:2] == ["self", "other"]
    assert not op_schema(torch.ops.aten.mm.default).is_mutable
