"""Models whose memory depends on tensor values (nonzero, boolean masks, unique, routing):
graphmem records them at their largest sizes (an upper bound).  With an input that keeps every
element the real run reaches the bound exactly; with random inputs it stays below it."""

from __future__ import annotations

import torch
from torch import nn


class RowGate(nn.Module):
    """Keeps the rows whose input sums are positive (boolean-mask indexing), then a Linear."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = x[x.sum(-1) > 0]
        return self.out(torch.relu(self.fc(kept)))


class Selects(nn.Module):
    """nonzero, masked_select and unique on the input, each feeding memory that follows."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        positions = (x > 0).nonzero()
        picked = x.masked_select(x > 0) * self.scale
        distinct = torch.unique(x)
        return h.sum() + picked.sum() + positions.float().sum() + distinct.sum()


class LoopMoE(nn.Module):
    """Mixture of experts written as a loop over experts with torch.where (top-2 routing)."""

    def __init__(self, dim: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                     for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(torch.softmax(self.router(x), -1), 2, dim=-1)
        mask = nn.functional.one_hot(chosen, len(self.experts)).permute(2, 1, 0)  # expert, slot, token
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out
