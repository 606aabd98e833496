"""A program whose module names torch.cuda.CUDAGraph in an annotation evaluated when the module
runs (as transformers 5.x's continuous batching does at import), then trains a step; with
``--capture`` it makes a CUDA graph, which graphmem run refuses."""

import sys

import torch
from torch import nn


def graph_for(key: tuple[int, ...]) -> torch.cuda.CUDAGraph | None:  # evaluated now: no __future__ import
    return None


model = nn.Linear(64, 64).to("cuda")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if "--capture" in sys.argv:
    torch.cuda.CUDAGraph()
for _ in range(2):
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
