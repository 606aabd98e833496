"""A plain PyTorch training loop, as people write them: the corpus on the CPU, one batch moved
to the device at a time, the next batch fetched while the step's graph is still alive.

    python examples/train_loop.py --batch-size 32
    graphmem run examples/train_loop.py --batch-size 32
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, args.hidden), nn.GELU(), nn.Linear(args.hidden, 1000)).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = torch.randn(16 * args.batch_size, 1000)
    labels = torch.randint(0, 1000, (16 * args.batch_size,))

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = slice((i % 16) * args.batch_size, (i % 16 + 1) * args.batch_size)
        return corpus[rows].to(args.device), labels[rows].to(args.device)

    x, y = batch(0)
    for step in range(args.steps):
        loss = F.cross_entropy(model(x), y)
        x, y = batch(step + 1)  # the next batch, fetched before the backward
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 5 == 0:
            print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
