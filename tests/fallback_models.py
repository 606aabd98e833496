"""Models whose constructors cannot run on the meta device, after patterns of real libraries.

torchvision is not a dependency, so these reproduce its patterns locally:

- ``RegNetLike``: torchvision's RegNet computes its stage widths with tensor arithmetic
  (``BlockParams.from_init_params``: ``torch.round``, ``torch.pow``, then ``.int().tolist()``);
  here per stage on scalar tensors read with ``int()`` and ``.item()``.  The meta device
  cannot read them; fake tensors know scalar constants.
- ``DropPathNet``: timm's drop-path schedule, ``torch.linspace(0, rate, depth).tolist()``;
  neither meta nor fake tensors know the values of a 4-element tensor: built for real.
- ``UniqueWidths``: sizes from ``torch.unique`` (an output shape that depends on values):
  built for real.
- ``BuggyConfig``: a genuine bug (a missing config key), after a value read, so that only
  the real build reaches it.
- ``HugeAfterRead``: a value read, then 6.4 GB of weights: past the real-build limit.
- ``ExitsAfterRead``: a value read, then ``sys.exit``; ``ArgvAfterRead`` records sys.argv.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RegNetLike", "DropPathNet", "UniqueWidths", "BuggyConfig", "HugeAfterRead", "ExitsAfterRead",
           "ArgvAfterRead"]


def _regnet_widths(depth: int, w_0: int, w_a: float, w_m: float, quant: int = 8) -> list[int]:
    # torchvision.models.regnet.BlockParams.from_init_params, one stage at a time
    widths = []
    for i in range(depth):
        width = torch.tensor(w_0 + w_a * i)
        capacity = torch.round(torch.log(width / w_0) / math.log(w_m))
        widths.append(int(torch.round(w_0 * torch.pow(torch.tensor(w_m), capacity) / quant) * quant))
    return widths


class RegNetLike(nn.Module):
    """Conv stem, one strided conv-BN-ReLU stage per distinct width, pooled classifier."""

    def __init__(self, depth: int = 4, w_0: int = 8, w_a: float = 8.0, w_m: float = 2.0, classes: int = 10) -> None:
        super().__init__()
        widths = sorted(set(_regnet_widths(depth, w_0, w_a, w_m)))
        self.scale = torch.tensor(w_m).item()  # a plain float, read as .item()
        self.stem = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        stages: list[nn.Module] = []
        for w_in, w_out in zip(widths, widths[1:], strict=False):
            stages += [nn.Conv2d(w_in, w_out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(w_out), nn.ReLU()]
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(x.mean((2, 3)))


class _Block(nn.Module):
    def __init__(self, dim: int, drop_path: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.drop_path = drop_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(F.gelu(self.fc1(self.norm(x))))
        if self.training and self.drop_path > 0:  # timm.layers.drop_path
            keep = 1 - self.drop_path
            mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep).div_(keep)
            y = y * mask
        return x + y


class DropPathNet(nn.Module):
    """Residual MLP blocks with a linear drop-path schedule, as timm's ViT builds it."""

    def __init__(self, dim: int = 32, depth: int = 4, drop_path_rate: float = 0.1, classes: int = 10) -> None:
        super().__init__()
        rates = torch.linspace(0, drop_path_rate, depth).tolist()  # timm: [x.item() for x in linspace(...)]
        self.blocks = nn.Sequential(*[_Block(dim, r) for r in rates])
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class UniqueWidths(nn.Module):
    """Hidden sizes from a value-dependent output shape; a tied embedding and head."""

    def __init__(self, vocab: int = 50, levels: tuple[int, ...] = (16, 16, 24, 24, 24)) -> None:
        super().__init__()
        hidden = [int(w) for w in torch.unique(torch.tensor(levels))]  # [16, 24]
        self.embed = nn.Embedding(vocab, hidden[0])
        self.up = nn.Linear(hidden[0], hidden[1])
        self.down = nn.Linear(hidden[1], hidden[0])
        self.head = nn.Linear(hidden[0], vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, counted once

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.embed(ids)))))


class BuggyConfig(nn.Module):
    """Reads a value (so every build but the real one stops before the bug), then a KeyError."""

    def __init__(self, config: dict[str, int] | None = None, levels: int = 3) -> None:
        super().__init__()
        config = config or {"hidden": 8}
        widths = torch.arange(1, levels + 1).mul(config["hidden"]).tolist()
        self.layers = nn.ModuleList(nn.Linear(w, w) for w in widths)
        self.out = nn.Linear(widths[-1], config["classes"])  # the bug: no such key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


class HugeAfterRead(nn.Module):
    """A value read, then 40000 x 40000 fp32 weights (6.4 GB): past the real-build limit."""

    def __init__(self) -> None:
        super().__init__()
        width = torch.tensor([40000, 40000]).tolist()[0]
        self.fc = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class ExitsAfterRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.arange(3).tolist()
        sys.exit(3)


class ArgvAfterRead(nn.Module):
    """Records sys.argv as the real build sees it."""

    def __init__(self) -> None:
        super().__init__()
        torch.arange(3).tolist()
        self.argv = list(sys.argv)
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)
