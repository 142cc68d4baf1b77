"""Optimizer steps that take whole accumulations after an elastic restart.

When ``scaling.keep_global_batch`` changes a run's accumulation at a restart on another
worker count, the checkpoint it restores may stand at a batch count that the new
accumulation does not divide (15 batches into the epoch on 2 workers accumulating 1,
restored on 1 worker accumulating 2). Lightning counts accumulations from the epoch's
start, so the first step after the restore would train on part of a global batch.
``AccumulationAlignment`` makes it count from the restored batch instead, for the rest of
that epoch; every later epoch counts from its start again.
"""

from __future__ import annotations

import lightning.pytorch as pl

from raytrain._compat.lightning import accumulate_from, restored_mid_epoch


class AccumulationAlignment(pl.Callback):
    """Counts accumulations from the batch a mid-epoch restore starts at (see the module
    docstring)."""

    def __init__(self) -> None:
        self.offset = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.offset = restored_mid_epoch(trainer) % trainer.accumulate_grad_batches
        accumulate_from(trainer, lambda: self.offset)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.offset = 0
