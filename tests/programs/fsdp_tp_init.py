"""FSDP2 over tensor parallelism on a GPU mesh (2 x 2 ranks), the model built on the meta device,
moved with ``to_empty`` and initialised with ``trunc_normal_`` on its DTensor parameters, as
torchtitan builds a model: DTensor's RNG tracker then asks which rows each rank holds under
FSDP's ``_StridedShard`` placement."""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh("cuda", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
with torch.device("meta"):
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"])
model.to_empty(device="cuda")
for p in model.parameters():
    nn.init.trunc_normal_(p, std=0.02)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    x = torch.randn(16, 256, device="cuda")
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
