"""A training loop written for a GPU: the corpus on the CPU, batches moved to the GPU, fp16
autocast with a GradScaler, positions made with device=x.device, a CPU copy of each loss kept,
and the loop's own memory log (torch.cuda's counters)."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 256)
        self.pos = nn.Embedding(64, 256)
        self.block = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.1)
        self.head = nn.Linear(256, 512)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.block(self.embed(idx) + self.pos(pos)))


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--corpus-rows", type=int, default=256)
args = parser.parse_args()
assert torch.cuda.is_available()
device = torch.device("cuda")
print("gpu", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)
model = Model().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda")
corpus = torch.randint(0, 512, (args.corpus_rows, 65))  # stays on the CPU
history = []
for step in range(args.steps):
    rows = corpus[step * 8 % 256:step * 8 % 256 + 8]
    x, y = rows[:, :-1].to(device, non_blocking=True), rows[:, 1:].to(device)
    with torch.autocast("cuda", dtype=torch.float16):
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, 512), y.reshape(-1))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    history.append(loss.detach().cpu())
    print("memory", torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(),
          torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved())
