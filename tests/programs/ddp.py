"""A data-parallel program as torchrun launches it: init_process_group from the environment
(gloo on the CPU, nccl on a GPU), DistributedDataParallel, AdamW, each rank its own batches."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank = dist.get_rank()
print(f"rank {rank} local {os.environ['LOCAL_RANK']} node {os.environ['GROUP_RANK']} world {dist.get_world_size()}")
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(device)
model = DistributedDataParallel(model, bucket_cap_mb=1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
torch.manual_seed(rank)
for step in range(5):
    x = torch.randn(16, 256, device=device)
    loss = F.mse_loss(model(x), x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
dist.destroy_process_group()
