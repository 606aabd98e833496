"""The model zoo the oracle tests run: small sizes, each a distinct memory behaviour."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt import GPT
from mlp import MLP
from simplenet import SimpleNet


class ResNetish(nn.Module):
    """Two residual blocks with BatchNorm and in-place ReLU, global pooling, a classifier."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                          nn.ReLU(inplace=True), nn.Conv2d(width, width, 3, padding=1, bias=False),
                          nn.BatchNorm2d(width)) for _ in range(2))
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = self.relu(x + block(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class RecurrentLM(nn.Module):
    """nn.Embedding -> GRU or LSTM -> linear head."""

    def __init__(self, cell: str = "gru", vocab: int = 100, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = (nn.GRU if cell == "gru" else nn.LSTM)(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(ids))
        return self.head(out)


class TiedAutoencoder(nn.Module):
    """Decoder weight is the encoder weight transposed: one storage, used twice."""

    def __init__(self, dim: int = 256, code: int = 64) -> None:
        super().__init__()
        self.enc = nn.Linear(dim, code)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.enc(x)), self.enc.weight.t(), self.bias)


class _UsesShared(nn.Module):
    def __init__(self, shared: nn.Module, dim: int) -> None:
        super().__init__()
        self.shared, self.own = shared, nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(torch.relu(self.shared(x)))


class SharedModule(nn.Module):
    """One module held by the model and by each of its blocks (as CoaT shares its position
    encodings): its parameters are reached by three paths and held once."""

    def __init__(self, dim: int = 256) -> None:
        super().__init__()
        self.encoding = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([_UsesShared(self.encoding, dim) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class RunningRange(nn.Module):
    """Keeps the running maximum of its inputs as a buffer assigned anew each call (as I-BERT's
    quantizers keep their range): a real run frees the old buffer at the assignment."""

    def __init__(self, dim: int = 256) -> None:
        super().__init__()
        self.register_buffer("top", torch.zeros(64, dim))
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.top = torch.maximum(self.top, x.detach().amax(0, keepdim=True).expand(64, -1))
        return self.fc(x) * self.top.mean()


class CheckpointedMLP(nn.Module):
    """Two blocks run through torch.utils.checkpoint (non-reentrant), one plain head."""

    def __init__(self, dim: int = 128) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                    for _ in range(2))
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class NestedNet(nn.Module):
    """blocks.0 (fc, act), blocks.1 (fc, act), head: Linear(4,4) x2 and Linear(4,2)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Block(), _Block())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class UnusedHead(nn.Module):
    """Returns (logits, pooled) where the loss uses only the logits: the pooling head's tanh
    saves its output for a backward that never runs, so that storage's last holder is the
    saved copy, freed only when the output is dropped (CLIP's and BERT's pooler, MoE router
    indices)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.pool = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.head(h), torch.tanh(self.pool(h[:, 0]))


@functools.lru_cache
def cached_positions(length: int, dim: int) -> torch.Tensor:
    """Position features cached by shape, as transformers' rotary and 2D position embeddings are."""
    return torch.arange(length * dim, dtype=torch.float32).view(length, dim) / (length * dim)


class CachedPositions(nn.Module):
    """Adds position features from a module-level cache: the tensor made by one call is
    returned to the next, whichever recording made it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x + cached_positions(x.shape[1], x.shape[2]))


class RealAttribute(nn.Module):
    """Holds a real tensor as a plain attribute, neither parameter nor buffer (torchvision's
    anchor generator keeps its cell anchors so): it stays real when the model is built on the
    meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.offsets = torch.arange(16.0, device="cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x + self.offsets.to(x.device))


def bf16_mlp() -> nn.Module:
    return MLP((256, 512, 10)).to(torch.bfloat16)


def transformer_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@dataclass(frozen=True)
class ZooModel:
    """A zoo entry: how to build it, its input specs, the loss, the int range of int inputs."""

    name: str
    build: Callable[[], nn.Module]
    inputs: tuple[str, ...]
    loss: str = "sum"
    int_high: int = 100
    marks: tuple[str, ...] = field(default=())


ZOO: tuple[ZooModel, ...] = (
    ZooModel("mlp", MLP, ("32x1000",)),
    ZooModel("simplenet", SimpleNet, ("16x1x28x28",), loss="nll", int_high=10),
    ZooModel("resnet", ResNetish, ("4x3x16x16",), loss="cross_entropy", int_high=10),
    ZooModel("gru", lambda: RecurrentLM("gru"), ("4x12:int64",), loss="cross_entropy"),
    ZooModel("lstm", lambda: RecurrentLM("lstm"), ("4x12:int64",), loss="cross_entropy"),
    ZooModel("transformer_encoder", transformer_encoder, ("2x10x64",)),
    ZooModel("gpt", lambda: GPT(vocab=100, dim=64, layers=2, heads=4, max_seq=64), ("2x16:int64",),
             loss="cross_entropy"),
    ZooModel("tied_autoencoder", TiedAutoencoder, ("8x256",), loss="mean"),
    ZooModel("shared_module", SharedModule, ("8x256",)),
    ZooModel("running_range", RunningRange, ("8x256",)),
    ZooModel("bf16_mlp", bf16_mlp, ("8x256:bf16",)),
    ZooModel("checkpointed_mlp", CheckpointedMLP, ("8x128",)),
)
