"""A classic MNIST network: two convolutions, Dropout2d, max-pooling, log_softmax.

    graphmem analyze examples/simplenet.py:SimpleNet --input 64x1x28x28 --loss nll
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SimpleNet(nn.Module):
    """conv(1->10, 5) -> pool -> relu -> conv(10->20, 5) -> dropout2d -> pool -> relu -> fc."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)
