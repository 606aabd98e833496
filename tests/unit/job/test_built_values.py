"""The values graphmem keeps for a model built on the meta device (graphmem.job.values): constants
and what is computed from them, compared with the same code run on CPU; never a random draw,
uninitialised memory, anything computed from those, or a tensor over the size limit."""

from __future__ import annotations

import torch

from graphmem.job.values import VALUE_LIMIT, built_value, kept_values


def _constants() -> dict[str, torch.Tensor]:
    k, s = torch.tensor(7, dtype=torch.int64), torch.as_tensor(2)
    freqs = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    table = torch.zeros(4, 3)
    table.copy_(torch.arange(12.0).reshape(4, 3))
    table[1] += 0.5
    return {"padding": k - s, "freqs": freqs, "table": table, "ids": torch.arange(10).expand(2, -1)}


def test_constants_and_what_follows_from_them_have_their_real_values() -> None:
    with torch.device("meta"), kept_values():
        built = _constants()
    for name, real in _constants().items():
        value = built_value(built[name])
        assert value is not None and torch.equal(value, real), name


def test_random_uninitialised_large_or_derived_from_those_have_none() -> None:
    with torch.device("meta"), kept_values():
        known = torch.ones(3)
        drawn, empty = torch.rand(3), torch.empty(3)
        mixed = known + drawn
        overwritten = torch.zeros(3)
        overwritten.copy_(drawn)
        initialised = torch.zeros(3).normal_()
        large = torch.zeros(VALUE_LIMIT + 1)
    assert built_value(known) is not None
    for t in (drawn, empty, mixed, overwritten, initialised, large):
        assert built_value(t) is None


def test_a_value_is_a_copy_and_nothing_is_kept_outside() -> None:
    with torch.device("meta"), kept_values():
        t = torch.tensor([1, 2, 3])
    first = built_value(t)
    assert first is not None
    first += 10
    assert torch.equal(built_value(t), torch.tensor([1, 2, 3]))  # type: ignore[arg-type]
    with torch.device("meta"):
        outside = torch.tensor([1, 2, 3])
    assert built_value(outside) is None
