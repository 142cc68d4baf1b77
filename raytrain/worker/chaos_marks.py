"""What every rank tells the run's fault injector (``failure.chaos``; the driver's
``ChaosMonkey``): that it trains, in which process on which node, and from which step;
rank 0 also each step it finishes, and its group's first step's time, so each injected
fault knows what it cost. Fire-and-forget actor calls, in order per caller: a test mode's
cost, about a millisecond a step on rank 0."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from ray.actor import ActorHandle


class ChaosMarks(pl.Callback):
    """Marks for the ``monkey`` actor (see the module docstring)."""

    def __init__(self, monkey: ActorHandle, node: str):
        self.monkey, self.node = monkey, node
        self._last_step = -1
        self._first_pending = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        self._last_step = step
        self._first_pending = trainer.global_rank == 0
        self.monkey.register.remote(
            trainer.global_rank, os.getpid(), self.node, trainer.world_size, step
        )

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        idx: int,
    ) -> None:
        step = trainer.global_step
        if trainer.global_rank != 0 or step == self._last_step:  # accumulating
            return
        self._last_step = step
        if self._first_pending:
            self._first_pending = False
            self.monkey.first_step.remote(step, time.time())
        else:
            self.monkey.step.remote(step)
