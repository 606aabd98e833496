"""Model code that caches a tensor by shape (``functools.lru_cache`` on position embeddings, as
SAM 3, DINOv3 and MaskFormer do) is recorded as a fresh process runs it: the cached tensor is made,
and counted, in each mode's recording, not handed from the inference recording to the training
one.  Checked against real CPU runs, each with the caches emptied first (a job's first step)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import graphmem
from tests.oracles import OPTIMIZERS, measure_inference, measure_training


@functools.lru_cache(maxsize=4)
def _positions(rows: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # made through a temporary 16 times its size: while it is made, it sets the peak
    return torch.arange(rows * dim * 16, dtype=dtype, device=device).reshape(rows, dim, 16).mean(-1)


def _cached_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """A cache inside a decorator's closure, as transformers' compile_compatible_method_lru_cache."""
    cached = functools.lru_cache(maxsize=4)(method)

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return cached(*args, **kwargs)
    return wrapper


class CachedPositions(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)
        self.where = where

    @staticmethod
    @_cached_method
    def table(rows: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.linspace(0, 1, rows * dim * 16, dtype=dtype, device=device).reshape(rows, dim, 16).mean(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        make = _positions if self.where == "module" else self.table
        h = torch.relu(self.fc1(x))
        return self.fc2(h + make(h.shape[0], h.shape[1], h.dtype, h.device))


def _fresh() -> None:
    _positions.cache_clear()
    CachedPositions.table.__closure__[0].cell_contents.cache_clear()  # type: ignore[index]


@pytest.mark.parametrize("where", ["module", "closure"])
def test_each_mode_counts_the_cached_tensor_as_a_fresh_run_does(where: str) -> None:
    build = lambda: CachedPositions(where)
    report = graphmem.analyze(build, ["128x64"], mode="both", optimizer="adam", loss="sum")
    assert report.inference is not None and report.train is not None
    x = torch.randn(128, 64)
    _fresh()
    inference = measure_inference(build, [x]).peak_bytes
    _fresh()
    train = measure_training(build, [x], OPTIMIZERS["adam"], "sum").peak_bytes
    assert (report.inference.peak_bytes, report.train.peak_bytes) == (inference, train)
    _fresh()
