"""PyTorch's FSDP2 tutorial program, as torchrun starts it on each GPU (pytorch/examples,
distributed/FSDP2/example.py and model.py, and the tutorial "Getting Started with Fully
Sharded Data Parallel (FSDP2)"): the device from ``torch.accelerator`` (and at least two GPUs
asked of it), the backend from ``get_default_backend_for_device``, the model built on the meta
device, ``fully_shard(layer)`` for each block then ``fully_shard(model)`` with no mesh given
(FSDP2's default: a mesh of the accelerator's type over the world), ``to_empty`` on the
device, Adam, gradient clipping.  Written here from the tutorial's pattern, 4 blocks instead of
10; no checkpoint saved.

``--cpu``: the same program on the CPU with gloo (the tutorial's branch for a machine without
an accelerator), for the comparison: the bytes of each category are the device's own."""

import argparse
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.1


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.n_heads = args.n_heads
        self.dropout_p = args.dropout_p
        self.resid_dropout = nn.Dropout(args.dropout_p)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(4))

    def forward(self, x):
        bsz, seq_len, _ = x.size()
        q, k, v = (w(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, None, self.dropout_p if self.training else 0)
        return self.resid_dropout(self.wo(out.transpose(1, 2).contiguous().view(bsz, seq_len, -1)))

    def reset_parameters(self):
        for w in (self.wq, self.wk, self.wv, self.wo):
            w.reset_parameters()


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, dropout_p):
        super().__init__()
        self.w1, self.gelu, self.w2 = nn.Linear(dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x):
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))

    def reset_parameters(self):
        self.w1.reset_parameters()
        self.w2.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(args.dim), nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.dropout_p)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self):
        for m in (self.attention_norm, self.attention, self.ffn_norm, self.feed_forward):
            m.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.max_seq_len = args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        _bsz, seq_len = tokens.size()
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(0, seq_len, device=tokens.device))
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()

    def reset_parameters(self):
        for m in (self.tok_embeddings, self.pos_embeddings, self.norm, self.output):
            m.reset_parameters()


def verify_min_gpu_count(min_gpus=2):
    return torch.accelerator.is_available() and torch.accelerator.device_count() >= min_gpus


def main(args):
    if not args.cpu and not verify_min_gpu_count(min_gpus=2):
        print("Unable to locate sufficient 2 gpus to run this example. Exiting.")
        exit()
    rank = int(os.environ["LOCAL_RANK"])
    if not args.cpu and torch.accelerator.is_available():
        device_type = torch.accelerator.current_accelerator()
        device = torch.device(f"{device_type}:{rank}")
        torch.accelerator.set_device_index(rank)
        print(f"Running on rank {rank} on device {device}")
    else:
        device = torch.device("cpu")
        print(f"Running on device {device}")
    backend = torch.distributed.get_default_backend_for_device(device)
    torch.distributed.init_process_group(backend=backend, device_id=None if args.cpu else device)

    torch.manual_seed(0)
    vocab_size, batch_size, seq_len = 1024, 32, 64
    model_args = ModelArgs(n_layers=4, n_heads=4, vocab_size=vocab_size, max_seq_len=seq_len, dropout_p=0)
    with torch.device("meta"):
        model = Transformer(model_args)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=device)
    model.reset_parameters()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(10):
        x = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)
        loss = model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PyTorch FSDP2 example")
    parser.add_argument("--cpu", action="store_true")
    main(parser.parse_args())
