"""Data read as torchvision's MNIST reads its files: torch.frombuffer over the file's bytes, a
view of it per image; the tensor shares the buffer's memory (PyTorch allocates none for it)."""

import torch
from torch import nn

raw = bytearray(open(__file__, "rb").read() * 40)
images = torch.frombuffer(raw, dtype=torch.uint8)[: 64 * 16].view(64, 16)
model = nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(3):
    x = images[i * 8:(i + 1) * 8].float() / 255
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
