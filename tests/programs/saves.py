"""A loop that saves a checkpoint after every step (torch.save of the model and optimizer
state) into the folder given as its first argument."""

import sys
from pathlib import Path

import torch
from torch import nn

folder = Path(sys.argv[1])
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
opt = torch.optim.Adam(model.parameters())
for step in range(4):
    model(torch.randn(16, 64)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, folder / f"step{step}.pt")
