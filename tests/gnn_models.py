"""Graph neural networks from torch_geometric for the value tests: two message-passing layers
each, as its examples build them (GCN, GAT, GraphSAGE, GIN)."""

from __future__ import annotations

import torch
from torch import nn

FEATURES, HIDDEN, CLASSES = 32, 64, 8


def _layers(kind: str) -> tuple[nn.Module, nn.Module]:
    from torch_geometric.nn import GATConv, GCNConv, GINConv, SAGEConv

    if kind == "gcn":
        return GCNConv(FEATURES, HIDDEN), GCNConv(HIDDEN, CLASSES)
    if kind == "gat":
        return GATConv(FEATURES, HIDDEN // 4, heads=4), GATConv(HIDDEN, CLASSES, heads=1)
    if kind == "sage":
        return SAGEConv(FEATURES, HIDDEN), SAGEConv(HIDDEN, CLASSES)
    mlp = lambda a, b: nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, b))
    return GINConv(mlp(FEATURES, HIDDEN)), GINConv(mlp(HIDDEN, CLASSES))


class Net(nn.Module):
    """Two layers of ``kind`` with a ReLU between: ``forward(x, edge_index)``."""

    def __init__(self, kind: str = "gcn") -> None:
        super().__init__()
        self.first, self.second = _layers(kind)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x, edge_index).relu(), edge_index)


def random_graph(nodes: int, edges: int, seed: int) -> list[torch.Tensor]:
    """Node features and a random edge index (self-loops and repeats as chance gives them)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(nodes, FEATURES, generator=generator),
            torch.randint(0, nodes, (2, edges), generator=generator)]
