"""A pipelined program as torchrun launches it: a device mesh of pipeline stages by data
parallel replicas ("pp" outermost, as torchtitan lays it out), each rank builds its stage's part
of the model and a PipelineStage without example shapes, so the stages tell each other their
shapes at run time; GPipe over 4 microbatches, AdamW. The stages differ: the first holds the
embedding, the last the head and the loss."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

STAGES = int(os.environ.get("PP", "2"))
SCHEDULE = os.environ.get("SCHEDULE", "gpipe")
VOCAB, WIDTH, BLOCKS, SEQ = 512, 128, 4, 32

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
world = dist.get_world_size()
mesh = init_device_mesh("cpu" if not torch.cuda.is_available() else "cuda", (STAGES, world // STAGES),
                        mesh_dim_names=("pp", "dp"))
pp = mesh["pp"]
stage_index = pp.get_local_rank()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stage(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        per = BLOCKS // STAGES
        self.embed = nn.Embedding(VOCAB, WIDTH) if index == 0 else None
        self.blocks = nn.ModuleList(Block() for _ in range(per))
        self.head = nn.Linear(WIDTH, VOCAB) if index == STAGES - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


torch.manual_seed(stage_index)
model = Stage(stage_index).to(device)
stage = PipelineStage(model, stage_index, STAGES, device, group=pp.get_group())
schedule = (ScheduleGPipe if SCHEDULE == "gpipe" else Schedule1F1B)(stage, n_microbatches=4, loss_fn=loss_fn)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
torch.manual_seed(100 + mesh["dp"].get_local_rank())
for step in range(3):
    tokens = torch.randint(0, VOCAB, (8, SEQ), device=device)
    if stage_index == 0:
        schedule.step(tokens)
    elif stage_index == STAGES - 1:
        schedule.step(target=tokens)
    else:
        schedule.step()
    opt.step()
    opt.zero_grad(set_to_none=True)
dist.destroy_process_group()
