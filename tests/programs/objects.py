"""A DDP program that exchanges Python objects between its ranks, as Lightning's DDP strategy
and many loggers do: a run name broadcast from rank 0, every rank's sample count gathered."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank = dist.get_rank()
name = ["run-0001"]
dist.broadcast_object_list(name, src=0)
counts = [None] * dist.get_world_size()
dist.all_gather_object(counts, {"rank": rank, "samples": 64})
assert name == ["run-0001"] and all(c is not None for c in counts)
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    x = torch.randn(16, 128)
    F.mse_loss(model(x), x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
dist.destroy_process_group()
