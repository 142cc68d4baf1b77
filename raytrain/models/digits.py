"""A small CNN for 8x8 digits: the default job's model.

Validation metrics are torchmetrics objects, so under DDP they are reduced over every rank's
shard at epoch end: ``val_acc`` is the accuracy on the whole validation set.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy


class DigitsCNN(pl.LightningModule):
    """Two 3x3 convolutions, a pooling step and a two-layer head over 10 classes."""

    def __init__(self, lr: float = 2e-3, channels: int = 16, hidden: int = 64):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * channels * 16, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )
        # Lightning's convention for a model's input: MLflow's signature and input example
        self.example_input_array = torch.zeros(2, 64)
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.val_loss = MeanMetric()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.net(pixels.view(-1, 1, 8, 8) / 16.0)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch["pixels"]), batch["label"])
        self.log("train_loss", loss, batch_size=len(batch["label"]))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch["pixels"])
        labels = batch["label"]
        self.val_loss.update(F.cross_entropy(logits, labels), weight=len(labels))
        self.val_acc.update(logits, labels)
        self.log("val_loss", self.val_loss, on_epoch=True, batch_size=len(labels))
        self.log("val_acc", self.val_acc, on_epoch=True, batch_size=len(labels))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
