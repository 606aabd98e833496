"""finer_units: the classes that split each FSDP2 unit into finer ones, or () where they cannot."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from torch import nn

from graphmem.trace import finer_units
from tests.conftest import ROOT


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"examples_{name}", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_layer_splits_into_its_attention_and_mlp() -> None:
    model = _example("decoder").Decoder(dim=32)
    assert finer_units(model, ("Layer",)) == ("Attention", "MLP")


def test_children_that_are_found_outside_the_units_do_not_split_them() -> None:
    # examples/gpt.py's Block holds its Linears itself, and the head is a Linear too
    assert finer_units(_example("gpt").GPT(dim=32), ("Block",)) == ()


class _Half(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)


class _Pair(nn.Module):
    def __init__(self, shared: nn.Linear | None = None) -> None:
        super().__init__()
        self.a, self.b = _Half(), _Half()
        if shared is not None:
            self.a.proj = shared


class _Stack(nn.Module):
    def __init__(self, tie: bool = False, one: bool = False) -> None:
        super().__init__()
        self.outside = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_Pair(self.outside if tie else None) for _ in range(2))
        if one:
            self.blocks[0].b = nn.Identity()


def test_a_tied_parameter_or_a_single_child_keeps_the_units() -> None:
    assert finer_units(_Stack(), ("_Pair",)) == ("_Half",)
    assert finer_units(_Stack(tie=True), ("_Pair",)) == ()  # a's weight is also the outside Linear's
    assert finer_units(_Stack(one=True), ("_Pair",)) == ()  # block 0 has one child with parameters
