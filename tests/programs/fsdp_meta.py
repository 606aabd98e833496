"""A sharded program built as torchtitan builds its models: on the meta device, sharded with
FSDP2, then ``to_empty`` on the rank's device (``torch.device("cpu", LOCAL_RANK)``, which a real
CPU tensor reports as plain "cpu") and initialised in place (``trunc_normal_`` on the DTensor
parameters reads its own random values); the optimizer a container whose step steps one
optimizer per part, as torchtitan's does (one step of the program's, not three); and a helper
module that makes a tensor when it is imported (each rank's process imports it, so each holds it).
"""

import os

import import_time_tensor  # noqa: F401  (its import makes a tensor it keeps)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Optimizers(torch.optim.Optimizer):
    """One optimizer per part, stepped together (torchtitan's OptimizersContainer's way)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.optimizers = [torch.optim.AdamW(part.parameters(), lr=1e-3) for part in parts]
        super().__init__([p for part in parts for p in part.parameters()], {})

    def step(self, closure: None = None) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
device = torch.device("cpu", int(os.environ["LOCAL_RANK"]))
with torch.device("meta"):
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)) for _ in range(3)))
for block in model:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
model.to_empty(device=device)
torch.manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        nn.init.trunc_normal_(p, std=0.02)
opt = Optimizers([model[0], model[1:]])
torch.manual_seed(dist.get_rank())
for step in range(5):
    x = torch.randn(8, 256).to(device)
    loss = F.mse_loss(model(x), x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
dist.destroy_process_group()
