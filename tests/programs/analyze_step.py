"""The step graphmem analyze records, written as a program: examples/mlp.py's MLP, a 32x1000
batch, Adam, loss = output.sum(), two iterations, each in a function whose locals die at return."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from mlp import MLP

model = MLP()
opt = torch.optim.Adam(model.parameters())
x = torch.randn(32, 1000)


def step() -> None:
    out = model(x)
    loss = out.sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(2):
    step()
