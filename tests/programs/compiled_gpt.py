"""A torch.compile'd GPT (examples/gpt.py, 2 blocks of 128) trained with AdamW on random tokens.

    --budget F       torch._functorch.config.activation_memory_budget = F (the partitioner
                     recomputes activations to save at most that fraction of what it would)
    --graph-break    the model's forward breaks its graph between its blocks (a print)
    --module         model.compile() in place of model = torch.compile(model)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT

parser = argparse.ArgumentParser()
parser.add_argument("--budget", type=float, default=None)
parser.add_argument("--graph-break", action="store_true")
parser.add_argument("--module", action="store_true")
args = parser.parse_args()
if args.budget is not None:
    torch._functorch.config.activation_memory_budget = args.budget


class Broken(GPT):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device)))
        print("between blocks")  # a graph break: two compiled graphs, the print run eagerly
        return self.head(self.ln_f(self.blocks[1](x)))


torch.manual_seed(0)
model = (Broken if args.graph_break else GPT)(vocab=512, dim=128, layers=2, heads=4, max_seq=128)
optimizer = torch.optim.AdamW(model.parameters())
if args.module:
    model.compile()
else:
    model = torch.compile(model)
ids = torch.randint(0, 512, (4, 128))
for _ in range(3):
    logits = model(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
