"""scikit-learn's digits as a LightningDataModule of ``TensorDataset``s, as a Lightning
project would write it: the same train/val split as the Parquet splits of
``datasets.digits`` (``write_splits``), so either feeds the same model the same rows."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain.datasets.digits import SPLIT_SEED, VAL_FRACTION


class DigitsDataModule(pl.LightningDataModule):
    """Train and val ``TensorDataset``s of ``(pixels, label)``: pixels 64 x float32 (0..16)."""

    def __init__(self, batch_size: int = 32):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels = torch.from_numpy(bunch.data.astype(np.float32))
        labels = torch.from_numpy(bunch.target.astype(np.int64))
        order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
        n_val = round(len(labels) * VAL_FRACTION)
        train, val = np.sort(order[n_val:]), np.sort(order[:n_val])
        self.train = TensorDataset(pixels[train], labels[train])
        self.val = TensorDataset(pixels[val], labels[val])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)
