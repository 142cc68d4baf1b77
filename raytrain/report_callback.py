"""When to checkpoint, what a checkpoint holds, and how a run restores from one.

``ReportCallback`` runs in every worker's Lightning Trainer. Every ``every_n_steps`` steps,
every ``every_n_epochs`` epochs and at the end of training it has every rank take part in
``trainer.save_checkpoint`` (the full Lightning state: weights, optimizer, schedulers, loops,
epoch, global step) into a local temporary folder and then call ``ray.train.report`` with
it, so Ray uploads it to the run's storage in the background and commits it only once
complete. Every rank reports at the same steps: a report is a barrier across ranks.

Metrics (every ``log_every_n_steps`` steps and with each checkpoint) go from rank 0 to
``publish`` instead, which does not wait: what the driver's progress line and MLflow see.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from raytrain.checkpoint import CKPT_FILE, META_FILE, MONITOR_MISSING, SCORE_KEY
from raytrain.system_metrics import SystemMetrics


def _scalar_metrics(trainer: pl.Trainer) -> dict[str, float]:
    out = {}
    for key, value in trainer.callback_metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


class ReportCallback(pl.Callback):
    """Reports metrics and checkpoints from every rank to Ray Train (see module docstring)."""

    def __init__(
        self,
        *,
        every_n_steps: int | None,
        every_n_epochs: int | None,
        log_every_n_steps: int,
        monitor: str | None = None,
        mode: str = "min",
        upload: str = "async",
        sharded: bool = False,
        publish: Callable[[dict[str, Any]], None] | None = None,
        startup: dict[str, float] | None = None,
        system: SystemMetrics | None = None,
    ):
        """``publish`` receives rank 0's metric events; None on the other ranks.
        ``system`` adds its ``system/...`` metrics to each report of training steps.

        ``startup`` holds wall-clock times of the worker's startup phases; they go out with
        the first event, beside the fit's start and the first step's end."""
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.log_every_n_steps = log_every_n_steps
        self.monitor = monitor
        self.mode = mode
        self.upload = upload
        self.sharded = sharded
        self.publish = publish
        # How long the last checkpoint held training up (saving, and a sync upload); sent
        # with the next metrics as ``checkpoint_blocked_s``.
        self._blocked_s: float | None = None
        self._last_ckpt_step: int | None = None
        self._last_step = -1
        self._last_report_step = -1
        self._samples = 0
        self._window_start = 0.0
        # Lightning keeps the last validation's values in callback_metrics for the rest of
        # the run; report them only from the report right after a validation.
        self._val_keys: set[str] = set()
        self._keys_before_val: set[str] = set()
        self._val_fresh = False
        self._score: float | None = None
        self._monitor_checked = False
        self._validated = False  # a validation (not the sanity check) has ended
        self._startup: dict[str, float] | None = dict(startup or {})
        self.system = system

    # -- Lightning hooks -------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._startup is not None:
            self._startup["_fit_started_at"] = time.time()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_ckpt_step = trainer.global_step
        self._last_step = trainer.global_step
        self._window_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self._startup is not None and "_first_step_at" not in self._startup:
            self._startup["_first_step_at"] = time.time()
        self._samples += _batch_rows(batch)
        step = trainer.global_step
        if step == self._last_step:  # still accumulating gradients
            return
        self._last_step = step
        if self.every_n_steps and step % self.every_n_steps == 0:
            self._checkpoint(trainer, "step")
        elif step % self.log_every_n_steps == 0:
            self._publish(self._metrics(trainer, "step"))

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._keys_before_val = set(trainer.callback_metrics)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._val_keys |= set(trainer.callback_metrics) - self._keys_before_val
        self._val_fresh = self._validated = True

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epochs_done = trainer.current_epoch + 1
        due = bool(self.every_n_epochs) and epochs_done % self.every_n_epochs == 0
        if due:
            self._checkpoint(trainer, "epoch")
        else:
            self._publish(self._metrics(trainer, "epoch"))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Whatever was trained since the last checkpoint is saved, so a finished run can be
        # resumed (e.g. with more epochs) without losing its last steps.
        if trainer.global_step != self._last_ckpt_step:
            self._checkpoint(trainer, "end")

    # -- reporting -------------------------------------------------------------------------

    def _metrics(self, trainer: pl.Trainer, kind: str) -> dict[str, Any]:
        """This report's metrics: train metrics if steps ran since the last report, val
        metrics if a validation ran since, and the checkpoint score Ray ranks by."""
        values = _scalar_metrics(trainer)
        metrics: dict[str, Any] = {}
        if trainer.global_step != self._last_report_step:
            now = time.perf_counter()
            elapsed = max(now - self._window_start, 1e-9)
            metrics.update({k: v for k, v in values.items() if k not in self._val_keys})
            metrics["samples_per_s"] = self._samples * trainer.world_size / elapsed
            if self.system is not None:
                metrics.update(self.system.sample(trainer.global_step))
            self._samples, self._window_start = 0, now
            self._last_report_step = trainer.global_step
        if self._val_fresh:
            metrics.update({k: values[k] for k in self._val_keys if k in values})
            self._val_fresh = False
        if self.monitor and self.monitor in metrics:
            self._score = metrics[self.monitor]
        if self.monitor and not self._monitor_checked:
            missing = monitor_missing(self.monitor, values, validated=self._validated)
            if missing is not None:
                self._monitor_checked = True
                if missing:
                    metrics[MONITOR_MISSING] = missing
        if self.monitor:
            # Ray ranks checkpoints by this key; one taken before the monitored metric was
            # first seen carries the worst score, so it never displaces a scored one.
            worst = -math.inf if self.mode == "max" else math.inf
            metrics[SCORE_KEY] = worst if self._score is None else self._score
        if self._blocked_s is not None:
            metrics["checkpoint_blocked_s"] = self._blocked_s
            self._blocked_s = None
        if self._startup is not None and "_first_step_at" in self._startup:
            metrics.update(self._startup)  # wall clock times, once: the startup breakdown
            self._startup = None
        metrics.update(
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            kind=kind,
            world_size=trainer.world_size,
        )
        return metrics

    def _publish(self, metrics: dict[str, Any]) -> None:
        if self.publish is not None:
            self.publish(metrics)

    def checkpoint_now(self, trainer: pl.Trainer, kind: str) -> None:
        """Checkpoint this step (unless it just was), and return once Ray Train's controller
        has taken the checkpoint: a report taken survives the worker group failing next,
        one still in the worker's queue is dropped with it."""
        import ray.train

        if trainer.global_step != self._last_ckpt_step:
            self._checkpoint(trainer, kind, upload="sync")
        # Ray's report queue holds one report: this one waits until the checkpoint's is taken.
        mode = ray.train.CheckpointUploadMode.SYNC
        ray.train.report({"step": trainer.global_step}, checkpoint_upload_mode=mode)

    def _save(self, trainer: pl.Trainer, metrics: dict[str, Any]) -> Any:
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
        if self.sharded:
            shared = trainer.strategy.broadcast(tmp)
            if shared != tmp:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp = shared
        # A collective: every rank calls it.
        trainer.save_checkpoint(os.path.join(tmp, CKPT_FILE))
        if self.sharded:
            trainer.strategy.barrier()  # every shard of this node is written
        if trainer.global_rank == 0:
            with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as handle:
                json.dump(metrics, handle)
        reports = trainer.global_rank == 0 or (
            self.sharded and ray.train.get_context().get_local_rank() == 0
        )
        if reports:
            return ray.train.Checkpoint.from_directory(tmp)
        if not self.sharded:
            shutil.rmtree(tmp, ignore_errors=True)
        return None

    def _checkpoint(self, trainer: pl.Trainer, kind: str, upload: str | None = None) -> None:
        import ray.train

        metrics = self._metrics(trainer, kind)
        self._publish(metrics)
        began = time.perf_counter()
        ckpt = self._save(trainer, metrics)
        # async: uploaded in the background, training goes on while Ray copies the folder
        # and waits for the controller to take the report. Either way Ray commits the
        # checkpoint (and deletes the local copy) only once the upload is complete, and
        # waits for pending uploads before the run ends.
        mode = ray.train.CheckpointUploadMode
        ray.train.report(
            metrics,
            checkpoint=ckpt,
            checkpoint_upload_mode=mode.ASYNC if (upload or self.upload) == "async" else mode.SYNC,
            delete_local_checkpoint_after_upload=ckpt is not None,
        )
        self._last_ckpt_step = trainer.global_step
        self._blocked_s = time.perf_counter() - began


def monitor_missing(monitor: str, known: dict[str, float], validated: bool) -> list[str] | None:
    """Whether ``checkpoint.monitor`` can be judged missing yet: None before the first
    validation's metrics are known (``validated``) unless ``monitor`` is already among
    ``known``; then [] when it is there, else the sorted keys that were reported instead."""
    if monitor in known:
        return []
    if not validated:
        return None
    return sorted(k for k in known if not k.startswith("_"))


def _batch_rows(batch: Any) -> int:
    if isinstance(batch, dict) and batch:
        first = next(iter(batch.values()))
        return len(first)
    try:
        return len(batch)
    except TypeError:
        return 0


class LoaderPosition(pl.Callback):
    """Keeps the train loader told where training is: which epoch starts (its shuffle order
    is (seed, epoch)) and how many of the epoch's batches have begun, which is the data
    position its ``state_dict`` saves in each checkpoint (Lightning's own batch count, so a
    prefetched batch is not counted as trained)."""

    def __init__(self, loader: Any):
        self.loader = loader

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A restore mid-epoch skips on_train_epoch_start; the restored loader knows its epoch.
        _refit_epoch_length(trainer, self.loader)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.loader.epoch = trainer.current_epoch
        _refit_epoch_length(trainer, self.loader)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.loader.position = batch_idx + 1


def _refit_epoch_length(trainer: pl.Trainer, loader: Any) -> None:
    """Give Lightning this epoch's length when it differs from the one it read at setup.

    Lightning reads a loader's length once, when fit starts, and before it restores the
    loader's state. A loader restored mid-epoch reports that epoch's length (steps done
    plus steps left), which differs from a whole epoch's when the world size changed since
    the checkpoint (an elastic restart); later epochs are whole again. Lightning would end
    such epochs early (dropping rows) or validate at the wrong batch.
    """
    try:
        length = len(loader)
    except TypeError:  # a streamed set: Lightning runs each epoch to the end of the data
        return
    fit_loop = trainer.fit_loop
    combined = fit_loop._combined_loader
    if combined is None or length == fit_loop.max_batches:
        return
    combined.limits = [length]
    fit_loop.max_batches = length
    fetcher = fit_loop._data_fetcher
    if fetcher is not None and fetcher.length is not None:  # already iterating this epoch
        fetcher.length = length
    if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch != float("inf"):
        trainer.val_check_batch = max(1, int(length * trainer.val_check_interval))
