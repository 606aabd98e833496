"""A training loop written for Hugging Face accelerate, as `accelerate launch train.py` runs it:
the Accelerator prepares the model, optimizer and data loader (DDP over the processes when
launched with several), and does the backward."""

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(cpu=not torch.cuda.is_available())
torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 128), torch.randint(0, 10, (256,)))
model = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=32, shuffle=True))
for x, y in loader:
    loss = F.cross_entropy(model(x), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
