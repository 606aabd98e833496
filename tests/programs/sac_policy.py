"""Selective activation checkpointing with torchtitan's device rule: a policy that saves every
``_to_copy`` from the GPU to the CPU (a device-to-host copy it will not redo) and the matmuls,
and recomputes the rest.  Each block norms (``F.rms_norm``: a float32 upcast and a ``type_as``
back), projects and sends one number to the host (``.cpu()``, a real device-to-host copy).

    python sac_policy.py [--device cuda] [--no-host-rule]

Prints ``host copies seen N``: the ``_to_copy`` ops the policy saw go from the GPU to the CPU
in the forward passes (one per block and step on a GPU: the ``.cpu()``; the norm's casts stay
on the GPU).  ``--no-host-rule`` leaves the rule out, which changes nothing on a GPU.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda")
parser.add_argument("--no-host-rule", action="store_true")
args = parser.parse_args()
seen = 0


def policy(ctx, func, *op_args, **kwargs):
    global seen
    to_host = (func == torch.ops.aten._to_copy.default and op_args[0].device.type == "cuda"
               and str(kwargs.get("device")) == "cpu")
    if to_host and not ctx.is_recompute:
        seen += 1
    if (to_host and not args.no_host_rule) or func == torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.proj = nn.Linear(dim, dim, bias=False)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(F.rms_norm(x, (x.shape[-1],), self.weight))
        h.detach().amax().cpu()  # a real copy to the host, inside the checkpointed region
        return x + F.silu(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(policy))


model = nn.Sequential(*(Block(256) for _ in range(4))).to(args.device, torch.bfloat16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x = torch.randn(8, 512, 256, device=args.device, dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"host copies seen {seen}", flush=True)
