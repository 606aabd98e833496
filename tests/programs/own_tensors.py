"""A loop that keeps data of its own: a CPU cache of every batch's logits (as a distillation or
analysis script would), gradient clipping, a learning-rate schedule, an evaluation forward under
no_grad between steps, SGD with momentum, and a log line that reads the loss."""

import argparse

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 256), nn.Flatten(), nn.Linear(256 * 8, 512), nn.ReLU(),
                          nn.LayerNorm(512), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    kept = torch.zeros(args.steps, args.batch_size, 10)  # the program's own tensor
    held_out = torch.randint(0, 1000, (64, 8))
    try:
        for step in range(args.steps):
            tokens = torch.randint(0, 1000, (args.batch_size, 8))
            labels = torch.randint(0, 10, (args.batch_size,))
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits, labels)
            kept[step] = logits.detach()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            schedule.step()
            model.eval()
            with torch.no_grad():
                score = model(held_out).argmax(-1).float().mean()
            model.train()
            print(f"step {step}: loss {loss.item():.3f} held-out {score.item():.3f}")
    finally:
        print("done")


if __name__ == "__main__":
    main()
