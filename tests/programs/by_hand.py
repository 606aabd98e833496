"""A loop that updates its parameters by hand (no torch.optim optimizer), as tutorials write
it: forward, loss, backward, then p -= lr * p.grad under no_grad and the gradients zeroed;
three iterations."""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 10))
for step in range(3):
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
            p.grad = None
