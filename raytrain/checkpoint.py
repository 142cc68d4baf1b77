"""When to checkpoint, what a checkpoint holds, and how a run restores from one.

``ReportCallback`` runs in every worker's Lightning Trainer. Every ``every_n_steps`` steps,
every ``every_n_epochs`` epochs and at the end of training it has every rank take part in
``trainer.save_checkpoint`` (the full Lightning state: weights, optimizer, schedulers, loops,
epoch, global step) into a local temporary folder and then call ``ray.train.report`` with
it, so Ray uploads it to the run's storage and commits it only once complete. Between
checkpoints it reports metrics alone every ``log_every_n_steps`` steps, which is what the
driver's progress line and MLflow see. Every rank reports at the same steps: a report is a
barrier across ranks.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from typing import Any

import lightning.pytorch as pl

CKPT_FILE = "checkpoint.ckpt"
META_FILE = "raytrain.json"


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
    ):
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.log_every_n_steps = log_every_n_steps
        self.monitor = monitor
        self.mode = mode
        self._last_ckpt_step: int | None = None
        self._last_step = -1
        self._samples = 0
        self._window_start = 0.0

    # -- Lightning hooks -------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_ckpt_step = trainer.global_step
        self._last_step = trainer.global_step
        self._window_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self._samples += _batch_rows(batch)
        step = trainer.global_step
        if step == self._last_step:  # still accumulating gradients
            return
        self._last_step = step
        if self.every_n_steps and step % self.every_n_steps == 0:
            self._report(trainer, "step", checkpoint=True)
        elif step % self.log_every_n_steps == 0:
            self._report(trainer, "step", checkpoint=False)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epochs_done = trainer.current_epoch + 1
        due = bool(self.every_n_epochs) and epochs_done % self.every_n_epochs == 0
        self._report(trainer, "epoch", checkpoint=due)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Whatever was trained since the last checkpoint is saved, so a finished run can be
        # resumed (e.g. with more epochs) without losing its last steps.
        if trainer.global_step != self._last_ckpt_step:
            self._report(trainer, "end", checkpoint=True)

    # -- reporting -------------------------------------------------------------------------

    def _metrics(self, trainer: pl.Trainer, kind: str) -> dict[str, Any]:
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        metrics: dict[str, Any] = _scalar_metrics(trainer)
        metrics.update(
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            kind=kind,
            samples_per_s=self._samples * trainer.world_size / elapsed,
            world_size=trainer.world_size,
        )
        self._samples, self._window_start = 0, now
        if self.monitor and self.monitor not in metrics:
            # Ray ranks checkpoints by this key; a checkpoint taken before the first validation
            # carries the worst possible score, so it never displaces a validated one.
            metrics[self.monitor] = -math.inf if self.mode == "max" else math.inf
        return metrics

    def _report(self, trainer: pl.Trainer, kind: str, *, checkpoint: bool) -> None:
        import ray.train

        metrics = self._metrics(trainer, kind)
        if not checkpoint:
            ray.train.report(metrics)
            return
        tmp = tempfile.mkdtemp(prefix="raytrain-ckpt-")
        try:
            # A collective: every rank calls it; rank 0 writes the file under DDP.
            trainer.save_checkpoint(os.path.join(tmp, CKPT_FILE))
            ckpt = None
            if trainer.global_rank == 0:
                with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as handle:
                    json.dump(metrics, handle)
                ckpt = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=ckpt)
            self._last_ckpt_step = trainer.global_step
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _batch_rows(batch: Any) -> int:
    if isinstance(batch, dict) and batch:
        first = next(iter(batch.values()))
        return len(first)
    try:
        return len(batch)
    except TypeError:
        return 0


def restore_path(checkpoint_dir: str) -> str:
    """The Lightning checkpoint file inside a raytrain checkpoint folder."""
    path = os.path.join(checkpoint_dir, CKPT_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{checkpoint_dir}: not a raytrain checkpoint (no {CKPT_FILE})")
    return path


def checkpoint_meta(checkpoint_dir: str) -> dict[str, Any]:
    """The metrics saved beside a checkpoint when it was taken."""
    with open(os.path.join(checkpoint_dir, META_FILE), encoding="utf-8") as handle:
        return json.load(handle)


# Ray Train's record of a run's committed checkpoints, beside them in the run's folder.
_RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


def latest_committed(run_dir: str) -> tuple[str, dict[str, Any]] | None:
    """The run's latest committed checkpoint (its URI and metrics), as Ray Train will restore.

    Ray writes its snapshot only after a checkpoint's upload completed, so a checkpoint
    named here is whole.
    """
    from raytrain import storage

    text = storage.read_text(storage.join(run_dir, _RAY_SNAPSHOT))
    if not text:
        return None
    latest = json.loads(text).get("latest_checkpoint_result")
    if not latest:
        return None
    return storage.join(run_dir, latest["checkpoint_dir_name"]), dict(latest.get("metrics", {}))
