from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from graphmem.errors import UserInputError
from graphmem.job.load import build_model, resolve_target
from tests.conftest import ROOT

SOURCE = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self, hidden=8):
        super().__init__()
        self.fc = nn.Linear(4, hidden)
    def forward(self, x):
        return self.fc(x)

def factory(hidden=8):
    return Net(hidden)

instance = nn.Linear(2, 2)
not_a_model = 42

def returns_int():
    return 3

class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        raise ValueError("constructor exploded")
"""


def test_resolves_dotted_module(make_module: Callable[[str], str]) -> None:
    name = make_module(SOURCE)
    assert resolve_target(f"{name}:Net").__name__ == "Net"


def test_resolves_file_path() -> None:
    cls = resolve_target(str(ROOT / "examples" / "mlp.py") + ":MLP")
    assert issubclass(cls, nn.Module)


def test_builds_on_meta_with_kwargs(make_module: Callable[[str], str]) -> None:
    name = make_module(SOURCE)
    for attr in ("Net", "factory"):
        model = build_model(resolve_target(f"{name}:{attr}"), {"hidden": 16})
        assert model.fc.weight.shape == (16, 4)
        assert model.fc.weight.device.type == "meta"


def test_instance_is_used_as_is(make_module: Callable[[str], str]) -> None:
    name = make_module(SOURCE)
    source = resolve_target(f"{name}:instance")
    assert build_model(source) is source


@pytest.mark.parametrize("target, fragment", [
    ("no_colon", "malformed target"),
    ("definitely_missing_pkg:Net", "cannot import module 'definitely_missing_pkg'"),
    ("{mod}:Missing", "has no attribute 'Missing'"),
    ("{mod}:not_a_model", "is a int, not an nn.Module"),
    ("missing_file.py:Net", "file not found"),
])
def test_bad_targets(make_module: Callable[[str], str], target: str, fragment: str) -> None:
    name = make_module(SOURCE)
    with pytest.raises(UserInputError) as info:
        resolve_target(target.format(mod=name))
    assert fragment in str(info.value)


@pytest.mark.parametrize("attr, kwargs, fragment", [
    ("Raises", {}, "constructor exploded"),
    ("returns_int", {}, "returned a int, not an nn.Module"),
    ("Net", {"nope": 1}, "unexpected keyword argument 'nope'"),
])
def test_bad_constructions(make_module: Callable[[str], str], attr: str, kwargs: dict[str, int],
                           fragment: str) -> None:
    name = make_module(SOURCE)
    with pytest.raises(UserInputError) as info:
        build_model(resolve_target(f"{name}:{attr}"), kwargs)
    assert fragment in str(info.value)


def test_big_model_allocates_nothing() -> None:
    # 4 x (32768 x 32768) fp32 = 16 GiB if it were real; on meta it costs nothing.
    model = build_model(lambda: nn.Sequential(*[nn.Linear(32768, 32768, bias=False) for _ in range(4)]))
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 4 * 32768 * 32768
    assert torch.empty(0).device.type == "cpu"  # the default device was restored
