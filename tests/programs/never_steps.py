"""A program that never reaches an optimizer step: it waits for data that never comes."""

import torch

seen = torch.zeros(10)


def wait_for_data() -> None:
    while True:
        seen.add_(1)  # the line graphmem run names when --timeout stops it


wait_for_data()
