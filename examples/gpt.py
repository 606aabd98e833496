"""A GPT-style decoder: pre-norm blocks, causal F.scaled_dot_product_attention, tied head.

    graphmem analyze examples/gpt.py:GPT --input 2x256:int64 --loss cross_entropy
    graphmem analyze examples/gpt.py:gpt_6_7b --input 1x4096:int64 --optimizer adamw

The second line is the 6.7B-parameter shape (32 layers, hidden 4096, 32 heads, vocab
32000): graphmem analyses it on the meta device in seconds, allocating no weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` blocks, final LayerNorm, head tied to the embedding."""

    def __init__(self, vocab: int = 1000, dim: int = 128, layers: int = 2, heads: int = 4,
                 max_seq: int = 1024) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_6_7b() -> GPT:
    """The 6.7B-parameter configuration: 32 layers, hidden 4096, 32 heads, vocab 32000."""
    return GPT(vocab=32000, dim=4096, layers=32, heads=32, max_seq=4096)
