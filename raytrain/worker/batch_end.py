"""``BatchEnd``: the callback that says a training batch's hooks have all run.

Callbacks that time a batch (``SystemMetrics``, ``StepTimeline``, ``HangWatchdog``) start
their clock first among the callbacks and stop it here, last among them: what follows
until the next batch starts is Lightning fetching it, and everything before it (reports,
checkpoint saves) belongs to the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import STEP_OUTPUT


class BatchEnd(pl.Callback):
    """Calls ``done(trainer)`` at each training batch's end; put it last."""

    def __init__(self, done: Callable[[pl.Trainer], None]):
        self.done = done

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        idx: int,
    ) -> None:
        self.done(trainer)
