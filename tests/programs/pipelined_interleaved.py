"""An interleaved pipeline as torchrun launches it: each rank holds two stages (rank r stages r
and r + world), Interleaved1F1B over 4 microbatches, no example shapes given, so stage r + world
waits on the shapes of stage r + world - 1, held by another rank (the ranks wait on each other
both ways)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

VOCAB, WIDTH, SEQ = 512, 128, 32
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
STAGES = 2 * world
device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Stage(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH) if index == 0 else None
        self.block = Block()
        self.head = nn.Linear(WIDTH, VOCAB) if index == STAGES - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.block(x)
        return self.head(x) if self.head is not None else x


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


indices = [rank, rank + world]
models = [Stage(i).to(device) for i in indices]
stages = [PipelineStage(m, i, STAGES, device) for m, i in zip(models, indices, strict=True)]
schedule = ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=loss_fn)
opt = torch.optim.AdamW([p for m in models for p in m.parameters()], lr=1e-3)
for step in range(3):
    tokens = torch.randint(0, VOCAB, (8, SEQ), device=device)
    if rank == 0:
        schedule.step(tokens)
    elif rank == world - 1:
        schedule.step(target=tokens)
    else:
        schedule.step()
    opt.step()
    opt.zero_grad(set_to_none=True)
dist.destroy_process_group()
