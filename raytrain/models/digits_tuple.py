"""The digits CNN written as Lightning's docs teach a module: its steps unpack
``x, y = batch``. The bundled LightningCLI job (``jobs/lightning_cli.yaml``) feeds it from a
LightningDataModule, and ``jobs/digits_tuple.yaml`` from Parquet with ``batch_format:
tuple``; its optimizer comes from the config's ``optimizer`` section (Adam without one)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raytrain.models.digits import DigitsCNN

Batch = tuple[torch.Tensor, torch.Tensor]


class DigitsClassifier(DigitsCNN):
    """``DigitsCNN`` for ``(pixels, label)`` batches."""

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, batch_size=len(y))
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:  # type: ignore[override]
        x, y = batch
        logits = self(x)
        self.val_loss.update(F.cross_entropy(logits, y), weight=len(y))
        self.val_acc.update(logits, y)
        self.log("val_loss", self.val_loss, on_epoch=True, batch_size=len(y))
        self.log("val_acc", self.val_acc, on_epoch=True, batch_size=len(y))
