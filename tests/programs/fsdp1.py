"""A program sharded with the first FullyShardedDataParallel (FSDP1), as torchrun launches it:
init_process_group from the environment, each block wrapped by an auto-wrap policy, the whole
model wrapped at the root (flat parameters), AdamW on the flat shards, each rank its own batches.
STRATEGY (a ShardingStrategy name), MIXED=1 (bfloat16 parameters in forward and backward) and
ORIG_PARAMS=0 (the flat parameters themselves given to the optimizer) vary it."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(256, 512), nn.Linear(512, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(*(Block() for _ in range(3)), nn.Linear(256, 256))
model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
             sharding_strategy=ShardingStrategy[os.environ.get("STRATEGY", "FULL_SHARD")],
             mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if os.environ.get("MIXED") else None,
             use_orig_params=os.environ.get("ORIG_PARAMS", "1") == "1")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
torch.manual_seed(dist.get_rank())
for step in range(5):
    x = torch.randn(8, 256)
    loss = F.mse_loss(model(x), x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
dist.destroy_process_group()
