"""A model built as torchtitan builds one: its blocks made one by one and added to a
``ModuleDict`` as they are made, each with its own initialiser (a depth-scaled std) and a
state-dict hook; launched by torchrun: built on the meta device, sharded per block with FSDP2
and moved with ``to_empty``; then initialised; AdamW, gradient clipping.

    python stacked.py [--device cuda] [--layers 12] [--checkpoint]

``--checkpoint`` wraps each block in activation checkpointing.  graphmem run records it with
four of its blocks and places the others (graphmem.trace.program.stacks): the same run as
recorded whole.  ``--built-first`` makes every block before the ``ModuleDict``: recorded whole.
"""

import argparse
import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cpu")
parser.add_argument("--layers", type=int, default=12)
parser.add_argument("--checkpoint", action="store_true")
parser.add_argument("--built-first", action="store_true")  # every block made before the ModuleDict
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, dim: int, layer: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.init_std = functools.partial(nn.init.trunc_normal_, std=0.02 / (2 * (layer + 1)) ** 0.5)
        self.down._register_state_dict_hook(lambda module, state, prefix, local: state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if args.checkpoint:
            return x + checkpoint(lambda h: self.down(F.gelu(self.up(self.norm(h)))), x, use_reentrant=False)
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        if args.built_first:
            self.layers = nn.ModuleDict({str(layer): Block(dim, layer) for layer in range(layers)})
        else:
            self.layers = nn.ModuleDict()
            for layer in range(layers):
                self.layers[str(layer)] = Block(dim, layer)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.head(h)


launched = "WORLD_SIZE" in os.environ
if launched:
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
with torch.device("meta" if launched else args.device):  # (one process: built where it trains)
    model = Model(512, 128, args.layers)
if launched:
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device=args.device)
with torch.no_grad():
    for block in model.layers.values():
        for p in block.parameters():
            block.init_std(p)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
torch.manual_seed(0)
for step in range(3):
    tokens = torch.randint(0, 512, (4, 64), device=args.device)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
if launched:
    dist.destroy_process_group()
