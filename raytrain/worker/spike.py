"""Loss spikes (``failure.spike``): found by the ranks together, rolled back past with the
rows up to the spike skipped.

``SpikeGuard`` runs at every batch's end, before any checkpoint of the step. The ranks
all-reduce the batch's loss, so each judges the same mean against the same window of
recent means (``rollback_record.robust_z``): they agree on a spike without another
collective, as ``FiniteGuard`` does on a NaN. At a spike rank 0 appends it, with the train
loader's position just after the spiked batch, to the run's ``rollbacks.json``, and a
broadcast tells every rank once it is written whether the budget is spent; then every rank
raises ``LossSpikeError`` (retried by the driver's failure policy, not counted against
``max_failures``) or ``LossSpikeLimitError`` (not retried). Nothing of the spiked step is
checkpointed: the checkpoint callback comes after the guard.

``RollbackSkip`` acts when the workers start again from the last committed checkpoint (which
is from before the spike: rank 0 first has the keeper of ``checkpoint.memory_every_n_steps``
drop its state, so the rollback does not resume from the step just before the spike). If
the last spike's position lies beyond the restored one, it moves the train loader to it,
keeping Lightning's count of the epoch's batches: the rows of the steps from the checkpoint
through the spiked batch are not trained again, and the epoch is that many steps shorter.
Rank 0 records the rollback's step and rows skipped, in ``rollbacks.json`` and as an event
for the driver's MLflow record. A restore after another failure that goes back before the
spike again skips again. A spike in a later epoch than a
mid-epoch checkpoint skips the spike's epoch up to it; the rest of the checkpoint's epoch is
trained (said in the record's notes).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from raytrain.contract import Publish, RollbackNotice
from raytrain.data.order import rows_trained, span
from raytrain.errors import LossSpikeError, LossSpikeLimitError
from raytrain.records.rollback_record import (
    Rollback,
    read_rollbacks,
    robust_z,
    write_rollbacks,
)
from raytrain.spec import SpikeSpec, StorageSpec
from raytrain.worker.loader_position import keeps_position, refit_epoch_length

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import STEP_OUTPUT


def batch_loss(trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT) -> float:
    """The batch's loss as ``training_step`` returned it (NaN: none). Lightning hands on the
    loss divided by the accumulation; multiplied back, a resize that changes the
    accumulation does not change the scale the window judges."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return math.nan
    scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
    return float(loss.detach()) * scale


def position_rows(loader: Any, state: dict[str, Any]) -> tuple[int, int]:
    """(epoch, rows of it trained) of a position of raytrain's loaders: a cached or
    map-style one's ``rows``, a streamed one's ``left`` of its ``num_rows``, a Ray Data
    shard's ``rows``."""
    return int(state["epoch"]), rows_trained(state, getattr(loader, "num_rows", 0), 0)


class SpikeGuard(pl.Callback):
    """Finds a loss spike on every rank at the same batch and stops the attempt there (see
    the module docstring). Its window of recent losses is saved in checkpoints."""

    def __init__(
        self,
        spike: SpikeSpec,
        run_dir: str,
        options: StorageSpec | None,
        train_loader: Callable[[], Any],
        forget_memory: Callable[[], None] | None = None,
    ):
        self.spike = spike
        self.forget_memory = forget_memory  # rank 0's, with checkpoint.memory_every_n_steps
        self.run_dir = run_dir
        self.options = options
        self.train_loader = train_loader
        self.losses: deque[float] = deque(maxlen=spike.window)

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.losses.extend(state_dict.get("losses", []))

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        idx: int,
    ) -> None:
        # every rank, every batch: the all-reduce is a collective
        value = torch.tensor([batch_loss(trainer, pl_module, outputs)], dtype=torch.float64)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            device = trainer.strategy.root_device  # a GPU under NCCL
            value = value.to(device)
            torch.distributed.all_reduce(value)
            value = value.cpu() / torch.distributed.get_world_size()
        loss = float(value[0])
        if not math.isfinite(loss):  # no loss this batch, or FiniteGuard's business
            return
        if len(self.losses) == self.losses.maxlen:
            z = robust_z(self.losses, loss)
            if z > self.spike.threshold:
                self._stop(trainer, idx, loss, z)
        self.losses.append(loss)

    def _stop(self, trainer: pl.Trainer, idx: int, loss: float, z: float) -> None:
        import statistics

        loader = self.train_loader()
        found = Rollback(
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            batch=idx,
            loss=loss,
            median=statistics.median(self.losses),
            z=z,
            window=len(self.losses),
            position=dict(loader.state_dict()) if keeps_position(loader) else None,
        )
        spent = 0
        if trainer.global_rank == 0:
            if self.forget_memory is not None:  # roll back to storage, not to the step before
                self.forget_memory()
            past = read_rollbacks(self.run_dir, self.options)
            spent = int(len(past) >= self.spike.max_rollbacks)
            if not spent:
                write_rollbacks(self.run_dir, [*past, found], self.options)
        # rank 0's record is written before any rank raises (a raise ends the attempt)
        spent = trainer.strategy.broadcast(spent, src=0)
        if spent:
            raise LossSpikeLimitError(
                f"the loss spiked again with failure.spike.max_rollbacks "
                f"({self.spike.max_rollbacks}) spent: {found.describe()}; the run stops "
                "(the earlier rollbacks are in rollbacks.json in the run folder and MLflow)"
            )
        raise LossSpikeError(
            f"loss spike: {found.describe()}; rolling back to the last checkpoint, skipping "
            "the rows up to this batch"
        )


def _progress(state: dict[str, Any]) -> tuple[int, int]:
    """A loader position, comparable with another of the same loader without its size:
    (epoch, rows trained) or, for a streamed split, (epoch, minus the rows left)."""
    if "left" in state and "rows" not in state:
        return int(state["epoch"]), -span([(int(lo), int(hi)) for lo, hi in state["left"]])
    return int(state["epoch"]), int(state.get("rows", 0))


class RollbackSkip(pl.Callback):
    """Moves a restored train loader past the run's last spike (see the module docstring).
    ``publish`` (rank 0's, else None) sends the rollback to the driver.

    Lightning loads a checkpoint's loader states and starts iterating the loaders before
    ``on_train_start``, so the skip is written into the checkpoint's loader state as it is
    loaded (``on_load_checkpoint``). A run restored with no checkpoint (a spike before the
    first one) gets it at ``setup`` when the spike was in epoch 0 and the loader exists
    (raytrain's own); else, as a spike in a later epoch than a mid-epoch checkpoint, when
    the spike's epoch starts (a user's loader made during fit, or raytrain's, whose batches
    are planned at their first batch, not when Lightning makes the iterator)."""

    def __init__(
        self,
        run_dir: str,
        options: StorageSpec | None,
        train_loader: Callable[[], Any],
        publish: Publish | None,
    ):
        self.run_dir = run_dir
        self.options = options
        self.train_loader = train_loader
        self.publish = publish
        self._rollbacks: list[Rollback] = []
        self._skip: tuple[dict[str, Any] | None, dict[str, Any]] | None = None  # (from, to)
        self._note: str | None = None
        self._pending: dict[str, Any] | None = None  # a later epoch's skip

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._rollbacks = read_rollbacks(self.run_dir, self.options)
        target = self._target()
        if target is None:
            return
        # The position of a run with no checkpoint (a spike before the first); a restore
        # replaces it (``on_load_checkpoint``). Loaded now only into a loader that exists
        # and for epoch 0 (Lightning makes its first iterator before any epoch hook);
        # anything else when its epoch starts.
        self._skip = (None, target)
        loader = self.train_loader()
        if int(target["epoch"]) == 0 and keeps_position(loader):
            loader.load_state_dict({**target, "steps": 0})
        else:
            self._pending = {**target, "steps": 0}

    def _target(self) -> dict[str, Any] | None:
        last = self._rollbacks[-1] if self._rollbacks else None
        return dict(last.position) if last is not None and last.position is not None else None

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        from raytrain._compat.lightning import checkpoint_at_epoch_end, checkpoint_loader_states

        self._skip, self._pending, target = None, None, self._target()
        states = checkpoint_loader_states(checkpoint)
        if target is None or len(states) != 1:
            return
        current = dict(states[0])
        if set(current) - {"steps", "world_size"} != set(target) - {"steps", "world_size"}:
            self._note = "the checkpoint's data position is another loader's: no rows skipped"
            return
        if _progress(target) <= _progress(current):  # restored from after the spike
            return
        self._skip = (current, target)
        if target["epoch"] == current["epoch"]:
            states[0] = {**target, "steps": current["steps"]}
            return
        # A later epoch: Lightning loads no loader state for an epoch it starts afresh. The
        # loader gets it when that epoch starts, and now too if it exists (a Ray Data shard
        # prefetches its first batches when Lightning makes the iterator); a checkpoint
        # from mid-epoch then replaces it with its own until that epoch's end.
        self._pending = {**target, "steps": 0}
        loader = self.train_loader()
        if keeps_position(loader):
            loader.load_state_dict(self._pending)
        if not checkpoint_at_epoch_end(checkpoint):
            at, to = current["epoch"], target["epoch"]
            self._note = (
                f"restored mid-epoch {at}, the spike was in epoch {to}: the rest of "
                f"epoch {at} was trained"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._rollbacks:
            return
        loader, rows = self.train_loader(), None
        if self._skip is not None and keeps_position(loader):
            start, target = self._skip
            start_rows = position_rows(loader, start)[1] if start is not None else 0
            same = start is None or int(start["epoch"]) == int(target["epoch"])
            rows = position_rows(loader, target)[1] - (start_rows if same else 0)
        elif self._rollbacks[-1].position is None:
            self._note = "the train loader keeps no position: no rows were skipped"
        self._record(trainer, rows)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pending, loader = self._pending, self.train_loader()
        if pending is not None and trainer.current_epoch == int(pending["epoch"]):
            self._pending = None
            if keeps_position(loader):  # raytrain's loaders read their position lazily
                loader.load_state_dict(pending)
                refit_epoch_length(trainer, loader)

    def _record(self, trainer: pl.Trainer, rows: int | None) -> None:
        """Rank 0: the last rollback's restored step and rows skipped, once, in the run's
        record and to the driver."""
        last = self._rollbacks[-1]
        if trainer.global_rank != 0 or last.restored_step is not None:
            return
        if rows is None and self._note is None:
            return  # restored from after the spike: nothing of this rollback's to record
        done = last.restored(trainer.global_step, rows, self._note)
        rollbacks = [*self._rollbacks[:-1], done]
        write_rollbacks(self.run_dir, rollbacks, self.options)
        print(f"raytrain: rollback {len(rollbacks)}: {done.describe()}", flush=True)
        if self.publish is not None:
            self.publish(RollbackNotice(step=trainer.global_step, rollbacks=tuple(rollbacks)))
