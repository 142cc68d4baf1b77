"""Rank 0 logs how many rows each source of a mixed train set gave so far."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import STEP_OUTPUT

MIX_ROWS_PREFIX = "data/rows/"


class MixRows(pl.Callback):
    """Logs ``data/rows/NAME`` for each source of a mixed train set: the rows it gave the
    run so far over all ranks, counted from the mix's order (``MixedStream.rows_seen``), so
    no rank need send its counts. Logged where ``MetricsReporter`` reports (every
    ``log_every_n_steps`` and at an epoch's end), before it in the callback order; any other
    train loader is left alone."""

    def __init__(self, loader: Callable[[], Any], log_every_n_steps: int):
        self._loader = loader
        self._every = max(1, log_every_n_steps)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = self._loader()
        if trainer.global_rank != 0 or not hasattr(loader, "rows_seen"):
            return
        import torch

        for name, rows in loader.rows_seen().items():  # float64: exact past 2**24 rows
            value = torch.tensor(rows, dtype=torch.float64)
            pl_module.log(MIX_ROWS_PREFIX + name, value, rank_zero_only=True)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_step % self._every == 0:
            self._log(trainer, pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, pl_module)
