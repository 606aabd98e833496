"""graphmem's own limits are exit 3 with what it cannot do; deep nesting is recorded."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from click.testing import CliRunner

from graphmem.cli import main

SOURCE = """
import torch
from torch import nn

class ReadsMemory(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
    def forward(self, x):
        x.detach().numpy()
        return self.fc(x)

class Deep(nn.Module):
    def __init__(self, depth=300):
        super().__init__()
        self.inner = Deep(depth - 1) if depth else nn.Linear(4, 4)
    def forward(self, x):
        return self.inner(x)
"""


@pytest.mark.parametrize("name", ["ReadsMemory"])
def test_reading_tensor_memory_is_graphmems_limit_exit_3(make_module: Callable[[str], str], name: str) -> None:
    module = make_module(SOURCE)
    result = CliRunner().invoke(main, ["check", f"{module}:{name}", "--input", "2x4", "--budget", "1GiB"])
    assert result.exit_code == 3, result.output
    assert "reads tensor memory directly" in result.output and "FITS" not in result.output


def test_a_model_nested_300_deep_is_recorded(make_module: Callable[[str], str]) -> None:
    module = make_module(SOURCE)
    result = CliRunner().invoke(main, ["analyze", f"{module}:Deep", "--input", "2x4", "--format", "json"])
    assert result.exit_code == 0, result.output
