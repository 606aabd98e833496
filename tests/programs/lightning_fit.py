"""A Lightning program as users write it: a LightningModule, a DataLoader over an in-memory
dataset, Trainer.fit with max_steps (no checkpoints, no logger, no progress bar).  The first
argument is the accelerator (default cpu; auto takes the GPU when there is one)."""

import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 128), torch.randn(256, 1))
trainer = L.Trainer(accelerator=sys.argv[1] if len(sys.argv) > 1 else "cpu", devices=1, max_steps=4,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(Regressor(), DataLoader(data, batch_size=32))
