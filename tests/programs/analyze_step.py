"""The step graphmem analyze records, written as a program: examples/mlp.py's MLP, a 32x1000
batch, Adam, loss = output.sum(), two iterations, each in a function whose locals die at return.
The device is the first argument (default cpu), the optimizer the second (adam or sgd: SGD with
momentum)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from mlp import MLP

device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
model = MLP().to(device)
optimizer = sys.argv[2] if len(sys.argv) > 2 else "adam"
opt = torch.optim.Adam(model.parameters()) if optimizer == "adam" else torch.optim.SGD(model.parameters(), momentum=0.9)
x = torch.randn(32, 1000, device=device)


def step() -> None:
    out = model(x)
    loss = out.sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(2):
    step()
