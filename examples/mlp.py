"""The model of a common article on training memory: a 1000-500-100 multilayer perceptron.

    graphmem analyze examples/mlp.py:MLP --input 32x1000
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """1000 -> 500 -> 100 with a ReLU between (about 550k parameters)."""

    def __init__(self, sizes: tuple[int, ...] = (1000, 500, 100)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=False)):
            layers.append(nn.Linear(n_in, n_out))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
