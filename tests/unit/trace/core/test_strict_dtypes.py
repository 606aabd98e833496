"""Inputs the real kernels refuse are refused, with PyTorch's own words (issue 13, part 4)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import graphmem
from graphmem.cli import main
from graphmem.errors import UserInputError
from tests.conftest import ROOT

MLP = str(ROOT / "examples" / "mlp.py") + ":MLP"


@pytest.mark.parametrize("dtype", ["int64", "float16", "bool"])
def test_an_input_the_real_linear_refuses_is_refused(dtype: str) -> None:
    real = torch.nn.Linear(4, 3)
    with pytest.raises(RuntimeError) as refused:
        real(torch.zeros(2, 4, dtype=getattr(torch, dtype)))
    with pytest.raises(UserInputError) as ours:
        graphmem.analyze(MLP, [f"2x1000:{dtype}"])
    assert str(refused.value).splitlines()[0] in str(ours.value)


def test_check_exits_2_not_fits() -> None:
    result = CliRunner().invoke(main, ["check", MLP, "--input", "32x1000:int64", "--budget", "1GiB"])
    assert result.exit_code == 2
    assert "must have the same dtype" in result.output and "FITS" not in result.output


def test_dtype_mixes_the_real_kernels_accept_are_analysed() -> None:
    """Embedding (int64 ids, float weights), bf16 weights with bf16 inputs: nothing refused."""
    gpt = str(ROOT / "examples" / "gpt.py") + ":GPT"
    assert graphmem.analyze(gpt, ["2x16:int64"], loss="cross_entropy").train is not None
    assert graphmem.analyze(MLP, ["2x1000:bf16"], dtype=torch.bfloat16).train is not None
