"""A pre-norm decoder whose layers hold their attention and their MLP as modules of their own,
as Llama's and most transformers' layers do (examples/gpt.py's Block holds its linears itself).

    graphmem analyze examples/decoder.py:Decoder --input 1x16:int64 --loss cross_entropy

Under FSDP2 either the layers or their attention and MLP modules can be the units
(``--fsdp-units Layer`` or ``--fsdp-units Attention,MLP``); ``plan --policy`` compares them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Causal self-attention: one projection to queries, keys and values, one out."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(dim, dim=-1))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))


class MLP(nn.Module):
    """4x GELU MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Layer(nn.Module):
    """One pre-norm layer: attention, then the MLP, each with its residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    """Token + position embeddings, ``layers`` layers, final LayerNorm, head tied to the embedding."""

    def __init__(self, vocab: int = 500, dim: int = 256, layers: int = 4, heads: int = 4,
                 max_seq: int = 1024) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))
