"""ZeRO-1 as torchrun launches it: DDP for the gradients, ZeroRedundancyOptimizer (AdamW) so
each rank keeps the optimizer state of its share of the parameters, each rank its own batches."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256),
                                              nn.Linear(256, 512)), bucket_cap_mb=1)
opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
torch.manual_seed(dist.get_rank())
for step in range(5):
    x = torch.randn(8, 256)
    loss = F.mse_loss(model(x)[:, :256], x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
dist.destroy_process_group()
