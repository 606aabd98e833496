"""A nanoGPT-style training script (written here, in its manner): a numpy memmap of token ids,
batches by torch.from_numpy(...).pin_memory().to(device, non_blocking=True), a small GPT with
weight tying and F.scaled_dot_product_attention, AdamW (fused on CUDA), autocast and a
GradScaler, torch.compile, an evaluation of both splits before training, gradient
accumulation, clipping, a checkpoint saved after each evaluation."""

import argparse
import contextlib
import inspect
import math
import os
import tempfile

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--block-size", type=int, default=64)
parser.add_argument("--accumulate", type=int, default=2)
parser.add_argument("--out", default=tempfile.mkdtemp(prefix="nanogpt_"))
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
device_type = "cuda" if "cuda" in device else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype) if device_type == "cuda" else contextlib.nullcontext()
torch.backends.cuda.matmul.allow_tf32 = True
torch.manual_seed(1337)

data = np.memmap(os.path.join(args.out, "train.bin"), dtype=np.uint16, mode="w+", shape=(20_000,))
data[:] = np.random.default_rng(0).integers(0, 512, size=data.shape)


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - args.block_size, (args.batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + args.block_size].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.block_size].astype(np.int64)) for i in ix.tolist()])
    if device_type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(args.block_size, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) if targets is not None else None
        return logits, loss


model = GPT().to(device)
fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), **({"fused": True} if fused else {}))
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
model = torch.compile(model)


@torch.no_grad()
def estimate_loss() -> float:
    model.eval()
    losses = torch.zeros(2)
    for k in range(2):
        x, y = get_batch()
        with ctx:
            _, loss = model(x, y)
        losses[k] = loss.item()
    model.train()
    return float(losses.mean())


x, y = get_batch()
for it in range(10):
    lr = 6e-4 * min(1.0, (it + 1) / 2) * 0.5 * (1 + math.cos(math.pi * it / 10))
    for group in optimizer.param_groups:
        group["lr"] = lr
    if it % 5 == 0:
        print(f"step {it}: val loss {estimate_loss():.4f}")
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(state, os.path.join(args.out, "ckpt.pt"))
    for micro in range(args.accumulate):
        with ctx:
            _, loss = model(x, y)
            loss = loss / args.accumulate
        x, y = get_batch()
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
