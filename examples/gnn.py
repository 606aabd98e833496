"""A graph network in plain PyTorch, as torch_geometric's GCNConv computes one: each layer drops
the graph's self-loops, adds one per node, and sums each node's messages from its neighbours.
How many edges remain after the self-loops are dropped depends on the edge index's values, so
graphmem needs the graph itself (``--sample``) for the exact peak; without it the peak is an
upper bound.

    graphmem analyze examples/gnn.py:GNN --input 2000x64 --input 2x20000:int64
    graphmem analyze examples/gnn.py:GNN --sample examples/gnn.py:sample
"""

import torch
from torch import nn


class GraphConv(nn.Module):
    def __init__(self, inp: int, out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(inp, out)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        keep = src != dst  # self-loops dropped, then one added per node
        loops = torch.arange(x.shape[0])
        src, dst = torch.cat([src[keep], loops]), torch.cat([dst[keep], loops])
        messages = self.lin(x).index_select(0, src)
        return torch.zeros(x.shape[0], messages.shape[1]).index_add(0, dst, messages)


class GNN(nn.Module):
    """Two graph convolutions: 64 features in, 256 hidden, 16 out."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = GraphConv(64, 256), GraphConv(256, 16)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x, edge_index).relu(), edge_index)


def sample() -> list[torch.Tensor]:
    """A random graph: 2,000 nodes with 64 features, 20,000 edges."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(2000, 64, generator=generator), torch.randint(0, 2000, (2, 20000), generator=generator)]
