"""A regression fitted with LBFGS, as pytorch/examples' time_sequence_prediction does: every
optimizer step calls the closure (forward and backward) up to max_iter times and keeps a
history of past directions."""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.LBFGS(model.parameters(), lr=0.8)
x, y = torch.randn(64, 8), torch.randn(64, 1)
criterion = nn.MSELoss()
for step in range(3):
    def closure():
        opt.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        return loss
    opt.step(closure)
