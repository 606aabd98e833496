"""Models whose memory depends on tensor values (nonzero, boolean masks, unique, routing):
graphmem records them at their largest sizes (an upper bound).  With an input that keeps every
element the real run reaches the bound exactly; with random inputs it stays below it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


class RowGate(nn.Module):
    """Keeps the rows whose input sums are positive (boolean-mask indexing), then a Linear."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 64)
        self.out = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = x[x.sum(-1) > 0]
        return self.out(torch.relu(self.fc(kept)))


class Selects(nn.Module):
    """nonzero, masked_select and unique on the input, each feeding memory that follows."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        positions = (x > 0).nonzero()
        picked = x.masked_select(x > 0) * self.scale
        distinct = torch.unique(x)
        return h.sum() + picked.sum() + positions.float().sum() + distinct.sum()


class Sampler(nn.Module):
    """A detection model's training sampler (as torchvision's BalancedPositiveNegativeSampler
    picks anchors or proposals): of the rows scored positive it takes at most ``pos``, of the
    others at most ``batch - pos``, each set as ones in a mask made from zeros; the head then
    runs on the rows of the masks' union.  Whatever the scores, at most ``batch`` rows."""

    def __init__(self, dim: int = 32, batch: int = 16, pos: int = 4) -> None:
        super().__init__()
        self.batch, self.pos = batch, pos
        self.score = nn.Linear(dim, 1)
        self.head = nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.score(x).squeeze(-1)
        positive = torch.where(scores.detach() > 0)[0]
        negative = torch.where(scores.detach() <= 0)[0]
        num_pos = min(positive.numel(), self.pos)
        num_neg = min(negative.numel(), self.batch - num_pos)
        pos_idx = positive[torch.randperm(positive.numel())[:num_pos]]
        neg_idx = negative[torch.randperm(negative.numel())[:num_neg]]
        pos_mask = torch.zeros_like(scores, dtype=torch.uint8)
        neg_mask = torch.zeros_like(scores, dtype=torch.uint8)
        pos_mask[pos_idx] = 1
        neg_mask[neg_idx] = 1
        sampled = torch.where(pos_mask | neg_mask)[0]
        return self.head(x[sampled]).sum() + scores.sum()


class SampledPositives(nn.Module):
    """A detection model's box and mask heads in training (torchvision's RoIHeads): rows get a
    label from their scores (2: matched, 0: background, -1: ignored); the sampler takes at most
    ``pos`` of the rows labelled >= 1 and fills ``batch`` with rows labelled 0; the box head runs
    on the sampled rows, the mask head on those sampled with a label > 0: whatever the scores,
    at most ``pos`` rows, though ``batch`` were sampled."""

    def __init__(self, dim: int = 32, batch: int = 16, pos: int = 4, relabel: bool = False) -> None:
        super().__init__()
        self.batch, self.pos, self.relabel = batch, pos, relabel  # relabel: every row positive once sampled
        self.score = nn.Linear(dim, 1)
        self.box_head = nn.Linear(dim, 8)
        self.mask_head = nn.Sequential(nn.Linear(dim, 1024), nn.ReLU(), nn.Linear(1024, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.score(x).squeeze(-1)
        labels = (scores.detach() > 0).long() * 2
        labels[scores.detach() < -0.5] = -1
        positive = torch.where(labels >= 1)[0]
        negative = torch.where(labels == 0)[0]
        num_pos = min(positive.numel(), self.pos)
        num_neg = min(negative.numel(), self.batch - num_pos)
        pos_mask = torch.zeros_like(labels, dtype=torch.uint8)
        neg_mask = torch.zeros_like(labels, dtype=torch.uint8)
        pos_mask[positive[torch.randperm(positive.numel())[:num_pos]]] = 1
        neg_mask[negative[torch.randperm(negative.numel())[:num_neg]]] = 1
        sampled = torch.where(pos_mask | neg_mask)[0]
        if self.relabel:
            labels.fill_(2)
        rows, sampled_labels = x[sampled], labels[sampled]
        foreground = torch.where(sampled_labels > 0)[0]
        return self.box_head(rows).sum() + self.mask_head(rows[foreground]).sum() + scores.sum()


class PredictedLength(nn.Module):
    """A text-to-speech length regulator (FastSpeech 2's, VITS'): each input row lasts a number
    of output frames the model predicts from its activations; the rows are repeated that often
    (``repeat_interleave``) and the total read as a number.  Nothing bounds the length but the
    values: graphmem needs ``--assume reads=N``.  ``total`` keeps the real run's length."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.duration = nn.Linear(dim, 1)
        self.decoder = nn.Sequential(nn.Linear(dim, 512), nn.ReLU(), nn.Linear(512, 8))
        self.total = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        durations = torch.clamp(torch.round(self.duration(x).squeeze(-1).exp() * 4), min=1).long()
        if durations.sum() == 0:  # a condition on predicted values
            durations[0] = 1
        frames = torch.repeat_interleave(x, durations, dim=0)
        self.total = int(durations.sum())
        positions = torch.arange(self.total, dtype=x.dtype).unsqueeze(-1)
        return self.decoder(frames + positions)


class RandomCrop(nn.Module):
    """Picks one of three lengths at random, as torchvision's detection transform picks an image
    size in training (``int(torch.empty(1).uniform_(0, n).item())``), then runs on that many rows."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lengths = (8, 16, 48)
        index = int(torch.empty(1).uniform_(0.0, float(len(lengths))).item())
        return self.fc(x[: lengths[index]])


class LoopMoE(nn.Module):
    """Mixture of experts written as a loop over experts with torch.where (top-2 routing)."""

    def __init__(self, dim: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                     for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(torch.softmax(self.router(x), -1), 2, dim=-1)
        mask = nn.functional.one_hot(chosen, len(self.experts)).permute(2, 1, 0)  # expert, slot, token
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        return out


class ExpertLoop(nn.Module):
    """A router's top-2 choice, then a loop over the experts hit (``nonzero``) that reads each
    expert's index (``if e == skipped``) and names its module by it (``self.experts[f"{e}"]``),
    as transformers' GPT-OSS-style and SwitchTransformers experts do."""

    def __init__(self, dim: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleDict({f"expert_{e}": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(),
                                                                   nn.Linear(4 * dim, dim)) for e in range(experts)})
        self.skipped = experts  # a padding index no token is routed to

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.topk(torch.softmax(self.router(x), -1), 2, dim=-1)
        mask = nn.functional.one_hot(chosen, len(self.experts)).permute(2, 1, 0)  # expert, slot, token
        out = torch.zeros_like(x)
        for hit in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            e = hit[0]
            if e == self.skipped:
                continue
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, self.experts[f"expert_{e}"](x[token]) * weights[token, slot, None])
        return out


class SplitMoE(nn.Module):
    """Top-1 routing by argmax; tokens sorted by expert and split by the expert sizes read as
    Python numbers (``.tolist()``), as transformers' JetMoE does."""

    def __init__(self, dim: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, 2 * dim) for _ in range(experts))
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = self.router(x).argmax(dim=-1)
        sizes = torch.bincount(chosen, minlength=len(self.experts)).tolist()
        order = chosen.argsort()
        parts = x[order].split(sizes)
        hidden = torch.cat([torch.relu(expert(part)) for expert, part in zip(self.experts, parts, strict=True)])
        return self.out(hidden)[order.argsort()]


class PaddedConv(nn.Module):
    """EnCodec's padded convolution: stride, kernel size and padding kept as one-element buffers
    computed when built, and the forward pads by their values."""

    def __init__(self, kernel: int = 7, stride: int = 2) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 16, kernel, stride)
        s, k = torch.tensor(stride, dtype=torch.int64), torch.tensor(kernel, dtype=torch.int64)
        self.stride = nn.Buffer(s, persistent=False)
        self.kernel_size = nn.Buffer(k, persistent=False)
        self.padding_total = nn.Buffer(k - s, persistent=False)
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        frames = torch.ceil((length - self.kernel_size + self.padding_total) / self.stride + 1).to(torch.int64) - 1
        extra = frames * self.stride + self.kernel_size - self.padding_total - length
        right = self.padding_total // 2
        left = self.padding_total - right
        if max(left, right + extra) >= length:
            raise ValueError("input too short to pad")
        h = self.conv(nn.functional.pad(x, (left, right + extra), mode="reflect"))
        return self.out(h.transpose(1, 2))


class RandomBuffer(nn.Module):
    """A buffer drawn at random when built, then read: its value is known to no one before the
    run, so graphmem refuses (as it does for a buffer written by an initialiser)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.threshold = nn.Buffer(torch.rand(()) if how == "rand" else torch.zeros(()).uniform_())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if self.threshold > 0.5 else self.fc(x).relu()


_CHOICES = {torch.ops.aten.topk.default, torch.ops.aten.argmax.default, torch.ops.aten.argmin.default,
            torch.ops.aten.max.dim, torch.ops.aten.min.dim}


def routed(sizes: list[int], dim: int, k: int, routing: str) -> torch.Tensor:
    """The choices of ``--assume routing``, written out: along ``dim`` (``n`` candidates), row
    ``r`` of the other dimensions picks, for ``j < k``, ``(r * k + j) % n`` (balanced), or
    ``(r + j) % n`` for ``r < n`` and ``j`` after (uneven)."""
    d = dim % len(sizes)
    n, other = sizes[d], sizes[:d] + sizes[d + 1:]
    rows = [[(r * k + j) % n if routing == "balanced" else (r + j) % n if r < n else j for j in range(k)]
            for r in range(int(torch.tensor(other).prod()) if other else 1)]
    return torch.tensor(rows, dtype=torch.int64).reshape([*other, k]).movedim(-1, d)


class ForcedRouting(TorchDispatchMode):
    """A real run whose top-k / argmax choices of floating-point values are those of
    ``--assume routing``: the ground truth for a prediction made under that assumption."""

    def __init__(self, routing: str) -> None:
        super().__init__()
        self.routing = routing

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CHOICES and args[0].is_floating_point() and args[0].dim() > 0:
            k, dim = (args[1], args[2] if len(args) > 2 else kwargs.get("dim", -1)) \
                if func is torch.ops.aten.topk.default else (1, args[1] if len(args) > 1 else kwargs.get("dim"))
            if dim is not None:
                indices = out[1] if isinstance(out, tuple) else out
                with torch.no_grad():
                    indices.copy_(routed(list(args[0].shape), dim, k, self.routing).reshape(indices.shape))
        return out
