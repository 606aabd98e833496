"""Every op the zoo's training steps run, on fake tensors with graphmem's rules applied, gives
outputs of the same sizes as the real CPU kernel: a meta kernel whose output is smaller (an
empty library workspace) or larger than the real one fails here, naming the op."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from graphmem._torch_api import DATA_DEPENDENT_ERRORS
from graphmem.trace.core.fake_mode import recording_fake_mode
from graphmem.trace.core.recorder import fixed_outputs
from graphmem.trace.rules import rules_for
from tests.models import ZOO, ZooModel
from tests.oracles import OPTIMIZERS, measure_training, real_inputs

_RULES = rules_for("cpu")


def _fake_outputs(func: Any, args: Any, kwargs: Any) -> Any:
    """``func`` on fake copies of its inputs, with the rules' output fixes applied as the
    recorder applies them; None when the fake kernel needs the values (an ``item()``)."""
    mode = recording_fake_mode()
    fake_args, fake_kwargs = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t,
                                      (args, kwargs))
    try:
        with mode:
            out = fixed_outputs(_RULES, func, fake_args, fake_kwargs, func(*fake_args, **fake_kwargs))
    except DATA_DEPENDENT_ERRORS:
        return None
    return out


def _nbytes(out: Any) -> list[int | None]:
    return [t.untyped_storage().nbytes() if isinstance(t, torch.Tensor) else None for t in tree_flatten(out)[0]]


class _Compare(TorchDispatchMode):
    """Runs each op that makes new outputs for real and on fakes; notes each op type whose
    output sizes differ."""

    def __init__(self) -> None:
        super().__init__()
        self.wrong: dict[str, tuple[list[int | None], list[int | None]]] = {}
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view or an in-place op: its output is an input's storage, no new memory
        self.ops.add(str(func))
        fake = _fake_outputs(func, args, kwargs)
        if fake is not None:
            real_sizes, fake_sizes = _nbytes(out), _nbytes(fake)
            if any(r is not None and f is not None and r != f for r, f in zip(real_sizes, fake_sizes, strict=False)):
                self.wrong.setdefault(str(func), (real_sizes, fake_sizes))
        return out


@pytest.mark.parametrize("model", ZOO, ids=lambda m: m.name)
def test_rules_give_every_zoo_op_its_real_output_size(model: ZooModel) -> None:
    compare = _Compare()
    with compare:
        measure_training(model.build, real_inputs(model.inputs, model.int_high), OPTIMIZERS["adam"], model.loss,
                         iterations=1)
    assert compare.ops, "no op was seen"
    assert not compare.wrong, f"op: (real output bytes, fake output bytes): {compare.wrong}"


def test_a_view_with_a_dimension_of_size_one_has_the_real_kernels_strides() -> None:
    """FakeTensor computes view strides in Python and differs from ATen for size-1 dims; the
    strides decide memory formats downstream (RADIO's position-embedding gradient)."""
    real = torch.empty_strided((1, 64, 4, 4), (1024, 1, 256, 64))
    shapes = ((1, 64, 16), (64, 16), (1, 1, 64, 16))
    expected = {shape: real.view(*shape).stride() for shape in shapes}  # real CPU views
    assert expected[(1, 64, 16)] == (64, 1, 64)
    mode = recording_fake_mode()
    with mode:
        fake = mode.from_tensor(real)
        for shape in shapes:
            view = fake.view(*shape)
            assert view.stride() == expected[shape], shape
            assert view._base is fake
