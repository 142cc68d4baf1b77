"""The one clock of a worker's steps: Lightning's hooks in, one reading per mark out.

Three things time a rank's steps: ``SystemMetrics`` (step time, the wait for data),
``StepTimeline`` (each part of a step) and ``HangWatchdog`` (how long since the rank last
moved). Each once implemented the same Lightning hooks and read the time itself. Now
``StepClock`` is the one Lightning callback: at each mark it reads the time and the
seconds spent so far in blocking collectives (its ``CollectiveTimer``: the gradients'
all-reduce and any collective the step runs, whoever calls it) once, as a ``Tick``, and
tells every ``StepListener`` in order. The listeners hold no Lightning hooks of their own.

Put the clock first among the callbacks and its ``end_marker()`` last (``BatchEnd``): a
batch's hooks (reports, checkpoint saves) belong to the batch, and what lies between the
marker's end and the next batch's start is Lightning fetching data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import lightning.pytorch as pl

from raytrain._compat.torch_collectives import CollectiveTimer
from raytrain.worker.batch_end import BatchEnd

if TYPE_CHECKING:
    import torch
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch.optim import Optimizer


class Tick(NamedTuple):
    """One reading of the clock at a mark: the time (``time.perf_counter``'s seconds) and
    the seconds this process has spent in blocking collectives up to it."""

    now: float
    waited: float


class StepListener:
    """Hears the step clock's marks, in Lightning's order; each method does nothing unless
    a subclass overrides it."""

    def train_started(self, tick: Tick, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Training starts (restored by now): once per fit."""

    def epoch_started(self, tick: Tick) -> None:
        """An epoch starts: its loader's new iterator comes next."""

    def batch_started(self, tick: Tick, trainer: pl.Trainer) -> None:
        """A training batch has been fetched; its forward starts."""

    def backward_started(self, tick: Tick) -> None:
        """A backward pass starts (the forward, or what ran since the last backward, ended)."""

    def backward_ended(self, tick: Tick) -> None:
        """A backward pass ended (the gradients' all-reduce with it, under DDP)."""

    def optimizer_started(self, tick: Tick) -> None:
        """The optimizer step starts (the last batch of an accumulation only)."""

    def batch_ended(self, tick: Tick) -> None:
        """The batch's own work ended; its end hooks (reports, checkpoints) start."""

    def batch_done(self, tick: Tick, trainer: pl.Trainer) -> None:
        """Every hook of the batch has run (the end marker)."""

    def validation_started(self, tick: Tick) -> None:
        """A validation starts (the sanity check too)."""

    def validation_batch_ended(self, tick: Tick) -> None:
        """A validation batch ended."""

    def validation_epoch_ended(self, tick: Tick) -> None:
        """The validation's batches ended; its end hooks (metrics synced) run."""

    def validation_ended(self, tick: Tick, trainer: pl.Trainer) -> None:
        """A validation ended (``trainer.sanity_checking`` says whether it was the check)."""

    def epoch_ended(self, tick: Tick) -> None:
        """A training epoch ended; its end hooks (reports, checkpoints) run."""

    def stopped(self) -> None:
        """Training ended or failed: the listener lets go of what it holds (a thread)."""


class StepClock(pl.Callback):
    """The step clock (see the module docstring). ``clock`` and ``collectives`` are
    parameters so that a unit test drives the marks with a clock of its own."""

    def __init__(
        self,
        listeners: Sequence[StepListener],
        clock: Callable[[], float] = time.perf_counter,
        collectives: CollectiveTimer | None = None,
    ):
        self.listeners = list(listeners)
        self.clock = clock
        # seconds in blocking collectives so far (installed at train start, world > 1)
        self.collectives = collectives if collectives is not None else CollectiveTimer(clock)

    def tick(self) -> Tick:
        return Tick(self.clock(), self.collectives.total)

    def end_marker(self) -> pl.Callback:
        """The callback to put last: it ends each batch after every other hook."""
        return BatchEnd(self._batch_done)

    def _batch_done(self, trainer: pl.Trainer) -> None:
        self._tell(lambda listener, tick: listener.batch_done(tick, trainer))

    def _tell(self, mark: Callable[[StepListener, Tick], None]) -> None:
        tick = self.tick()
        for listener in self.listeners:
            mark(listener, tick)

    # -- Lightning's hooks, in the order it calls them -------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size > 1:
            self.collectives.install()
        self._tell(lambda listener, tick: listener.train_started(tick, trainer, pl_module))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tell(lambda listener, tick: listener.epoch_started(tick))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int
    ) -> None:
        self._tell(lambda listener, tick: listener.batch_started(tick, trainer))

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self._tell(lambda listener, tick: listener.backward_started(tick))

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tell(lambda listener, tick: listener.backward_ended(tick))

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._tell(lambda listener, tick: listener.optimizer_started(tick))

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        idx: int,
    ) -> None:
        self._tell(lambda listener, tick: listener.batch_ended(tick))

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tell(lambda listener, tick: listener.validation_started(tick))

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._tell(lambda listener, tick: listener.validation_batch_ended(tick))

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tell(lambda listener, tick: listener.validation_epoch_ended(tick))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tell(lambda listener, tick: listener.validation_ended(tick, trainer))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tell(lambda listener, tick: listener.epoch_ended(tick))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for listener in self.listeners:
            listener.stopped()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.collectives.remove()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, err: BaseException
    ) -> None:
        self.collectives.remove()  # a failed fit runs no callback's teardown
        for listener in self.listeners:
            listener.stopped()
