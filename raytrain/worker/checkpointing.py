"""When a worker checkpoints, what a checkpoint holds, and how it reaches Ray Train.

``CheckpointCallback`` runs in every worker's Lightning Trainer. At the points its
``CheckpointSchedule`` names and at the end of training it has every rank take part in
``trainer.save_checkpoint`` (the full Lightning state: weights, optimizer, schedulers, loops,
epoch, global step) into a local temporary folder and then call ``ray.train.report`` with
it, so Ray uploads it to the run's storage in the background and commits it only once
complete. Every rank reports at the same steps: a report is a barrier across ranks. The
report's metrics come from the ``MetricsReporter``, which also publishes them to the driver.

A train loader that keeps no position (``loader_position.keeps_position``: a user's
loader over an iterable dataset) cannot be resumed mid-epoch exactly, so it is checkpointed
only where an epoch ends: a step checkpoint (or a preemption's) due within an epoch is
taken at that epoch's end instead, and a restore starts the next epoch with nothing
trained twice. Any loader's step checkpoint due at an epoch's last batch is taken at the
epoch's end too: taken in that batch's ``on_train_batch_end``, before the epoch's end ran,
its restore began the next epoch with no batches (``test_mid_epoch_resume``: the run ended
at step 60 of 90). The end of training is checkpointed wherever it falls; where ``max_steps``
ended it mid-epoch, that epoch is saved as unfinished (Lightning counts it done), so that
a resume with more steps trains the rest of it (a loader that keeps no position resumes at
the next epoch, as it does from any of its checkpoints).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from raytrain._compat.lightning import epoch_cut_short, epoch_last_batch, uncount_cut_epoch
from raytrain.checkpoints.interval import AutoInterval
from raytrain.checkpoints.layout import CKPT_FILE, META_FILE
from raytrain.worker.loader_position import keeps_position
from raytrain.worker.reporting import MetricsReporter
from raytrain.worker.schedule import CheckpointSchedule

if TYPE_CHECKING:
    import ray.train
    from lightning.pytorch.utilities.types import STEP_OUTPUT


class IntervalTuning:
    """``checkpoint.every_n_steps: auto`` (``auto``; None: a fixed interval): at each
    checkpoint it measures the checkpoint's cost and the step time since the last, rank 0
    chooses the interval with the run's MTBF from ``mtbf`` (rank 0's; None elsewhere), and
    every rank takes it (a broadcast: all checkpoint at the same steps). Rank 0 says so
    through ``reporter`` when it changes. Its state rides in checkpoints."""

    def __init__(
        self,
        auto: AutoInterval | None,
        mtbf: Callable[[], float | None] | None,
        schedule: CheckpointSchedule,
        reporter: MetricsReporter,
    ):
        self.auto, self.mtbf, self.schedule, self.reporter = auto, mtbf, schedule, reporter
        self.trained_since = time.perf_counter()  # training time since the last checkpoint

    def retune(self, trainer: pl.Trainer, blocked_s: float, began: float, steps: int) -> None:
        """After a checkpoint that held training up ``blocked_s``, begun at ``began``,
        ``steps`` after the last."""
        if self.auto is None:
            return
        self.auto.saved(blocked_s)
        self.auto.trained(steps, began - self.trained_since)
        choice = None
        if trainer.global_rank == 0:
            choice = self.auto.choose(self.mtbf() if self.mtbf is not None else None)
        chosen = choice.steps if choice is not None else self.schedule.every_n_steps
        chosen = trainer.strategy.broadcast(chosen, src=0)
        if chosen and chosen != self.schedule.every_n_steps:
            self.schedule.retune(trainer.global_step, int(chosen))
            if choice is not None:  # the driver prints it and tags the MLflow run
                self.reporter.interval_choice = choice.describe()
        self.reporter.checkpoint_interval = self.schedule.every_n_steps

    def state_dict(self) -> dict[str, Any]:
        """Under ``auto``: the interval chosen and the step it counts from, so a restore
        checkpoints where the run would have (and not at the first interval again)."""
        if self.auto is None:
            return {}
        return {"every_n_steps": self.schedule.every_n_steps, "anchor": self.schedule.anchor}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        steps = state_dict.get("every_n_steps")
        if self.auto is not None and isinstance(steps, int) and steps > 0:
            self.schedule.retune(int(state_dict.get("anchor", 0)), steps)


class CheckpointCallback(pl.Callback):
    """Saves and reports checkpoints from every rank (see the module docstring).

    ``upload`` is ``checkpoint.upload`` ("async" or "sync"). ``sharded``: sharded FSDP, where
    every rank writes its own shard (see ``save_local``). ``train_loader`` returns the train
    loader (None before there is one), read to know whether it can resume mid-epoch.
    ``auto`` and ``mtbf``: ``checkpoint.every_n_steps: auto`` (``IntervalTuning``).
    """

    def __init__(
        self,
        *,
        schedule: CheckpointSchedule,
        reporter: MetricsReporter,
        upload: str = "async",
        sharded: bool = False,
        train_loader: Callable[[], Any] = lambda: None,
        auto: AutoInterval | None = None,
        mtbf: Callable[[], float | None] | None = None,
    ):
        self.schedule = schedule
        self.train_loader = train_loader
        self._deferred = False  # a checkpoint due this epoch waits for its end
        self.reporter = reporter
        self.upload = upload
        self.sharded = sharded
        self._last_ckpt_step: int | None = None
        self._last_step = -1
        self.tuning = IntervalTuning(auto, mtbf, schedule, reporter)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_ckpt_step = trainer.global_step
        self._last_step = trainer.global_step
        self.tuning.trained_since = time.perf_counter()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        idx: int,
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:  # still accumulating gradients
            return
        self._last_step = step
        if not self.schedule.at_step(step):
            return
        if epoch_last_batch(trainer):  # at the epoch's end instead (the module docstring)
            self._deferred = True
        elif not self._defer(trainer):
            self._checkpoint(trainer, "step")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if epoch_cut_short(trainer):  # max_steps ended it: not an epoch's end, the run's
            return
        if self.schedule.at_epoch(trainer.current_epoch + 1) or self._deferred:
            self._deferred = False
            self._checkpoint(trainer, "epoch")

    def defer_to_epoch_end(self, trainer: pl.Trainer) -> bool:
        """Whether a checkpoint asked for now is taken at the epoch's end instead (a
        loader that keeps no position, mid-epoch); it then is (``on_train_epoch_end``)."""
        return not epoch_last_batch(trainer) and self._defer(trainer)

    def _defer(self, trainer: pl.Trainer) -> bool:
        """Whether a checkpoint due now, mid-epoch, waits for the epoch's end instead (see
        the module docstring); every rank answers alike (they share the loader's type)."""
        loader = self.train_loader()
        if loader is None or keeps_position(loader):
            return False
        if not self._deferred:
            dataset = type(getattr(loader, "dataset", loader)).__name__
            kind = f"{type(loader).__name__} over {dataset}"
            rank_zero_warn(
                f"raytrain: the train loader ({kind}) keeps no position (no state_dict/"
                "load_state_dict): checkpoints due within an epoch are taken at its end, "
                "where a restore resumes exactly"
            )
        self._deferred = True
        return True

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning counts an epoch that max_steps cut short as done: a checkpoint of it
        # would resume at the next epoch, the rest of this one never trained. A loader that
        # keeps no position would start the epoch over, training its first rows twice: it
        # resumes at the next epoch, as from any checkpoint it has.
        if epoch_cut_short(trainer) and keeps_position(self.train_loader()):
            uncount_cut_epoch(checkpoint)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Whatever was trained since the last checkpoint is saved, so a finished run can be
        # resumed (e.g. with more epochs) without losing its last steps.
        if trainer.global_step != self._last_ckpt_step:
            self._checkpoint(trainer, "end")
        elif epoch_cut_short(trainer):  # a validation after this step's checkpoint
            self.reporter.publish_unreported_validation(trainer)

    def checkpoint_now(self, trainer: pl.Trainer, kind: str) -> None:
        """Checkpoint this step (unless it just was), and return once Ray Train's controller
        has taken the checkpoint: a report taken survives the worker group failing next,
        one still in the worker's queue is dropped with it."""
        import ray.train

        if trainer.global_step != self._last_ckpt_step and not self._defer(trainer):
            self._checkpoint(trainer, kind, upload="sync")
        # Ray's report queue holds one report: this one waits until the checkpoint's is taken.
        mode = ray.train.CheckpointUploadMode.SYNC
        ray.train.report({"step": trainer.global_step}, checkpoint_upload_mode=mode)

    def _checkpoint(self, trainer: pl.Trainer, kind: str, upload: str | None = None) -> None:
        report = replace(self.reporter.collect(trainer, kind), checkpoint=True)
        self.reporter.publish(report)
        began = time.perf_counter()
        self._commit(trainer, report.for_ray(), upload or self.upload)
        blocked = time.perf_counter() - began
        self.reporter.checkpoint_blocked(blocked)
        if kind in ("step", "epoch"):  # every rank checkpoints here (a preemption's: maybe not)
            steps = trainer.global_step - (self._last_ckpt_step or 0)
            self.tuning.retune(trainer, blocked, began, steps)
        self._last_ckpt_step = trainer.global_step
        self.tuning.trained_since = time.perf_counter()

    def _commit(self, trainer: pl.Trainer, metrics: dict[str, Any], upload: str) -> None:
        """Save the checkpoint and hand it to Ray Train with ``metrics``."""
        import ray.train

        ckpt = save_local(trainer, metrics, self.sharded)
        # async: uploaded in the background, training goes on while Ray copies the folder
        # and waits for the controller to take the report. Either way Ray commits the
        # checkpoint (and deletes the local copy) only once the upload is complete, and
        # waits for pending uploads before the run ends.
        mode = ray.train.CheckpointUploadMode
        ray.train.report(
            metrics,
            checkpoint=ckpt,
            checkpoint_upload_mode=mode.ASYNC if upload == "async" else mode.SYNC,
            delete_local_checkpoint_after_upload=ckpt is not None,
        )

    def state_dict(self) -> dict[str, Any]:
        return self.tuning.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tuning.load_state_dict(state_dict)


def save_local(
    trainer: pl.Trainer, metrics: dict[str, Any], sharded: bool
) -> ray.train.Checkpoint | None:
    """Save the Lightning state into a local folder; returns the checkpoint this rank
    reports (None: nothing of this rank's to upload).

    DDP, or FSDP gathering a full state dict: rank 0 writes the one file. Sharded FSDP:
    every rank writes its own shard (torch distributed checkpoint) into rank 0's folder
    path, which Lightning broadcasts; on each node the ranks share that local folder and
    its local rank 0 reports it, so Ray uploads every node's shards into the one
    checkpoint folder (a folder reported by two ranks of a node would be deleted under
    the other's upload).
    """
    import ray.train

    tmp = tempfile.mkdtemp(prefix="raytrain-ckpt-")
    if sharded:
        shared = trainer.strategy.broadcast(tmp)
        if shared != tmp:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp = shared
    # A collective: every rank calls it.
    trainer.save_checkpoint(os.path.join(tmp, CKPT_FILE))
    if sharded:
        trainer.strategy.barrier()  # every shard of this node is written
    if trainer.global_rank == 0:
        with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as handle:
            json.dump(metrics, handle)
    reports = trainer.global_rank == 0 or (
        sharded and ray.train.get_context().get_local_rank() == 0
    )
    if reports:
        return ray.train.Checkpoint.from_directory(tmp)
    if not sharded:
        shutil.rmtree(tmp, ignore_errors=True)
    return None
