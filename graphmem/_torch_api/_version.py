"""The torch versions graphmem runs on: checked first, before any private name is imported."""

from __future__ import annotations

import torch

__all__ = ["MIN_TORCH"]

MIN_TORCH = (2, 4)
if tuple(int(p) for p in torch.__version__.split(".")[:2]) < MIN_TORCH:  # pragma: no cover
    raise ImportError(f"graphmem needs torch >= 2.4, found {torch.__version__}")
