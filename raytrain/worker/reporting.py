"""What a worker reports: rank 0's metric events, and the metrics each checkpoint carries.

``MetricsReporter`` runs in every worker's Lightning Trainer. Every ``log_every_n_steps``
steps and at each epoch's end (unless a checkpoint reports that point, see ``schedule``) it
sends rank 0's metrics to ``publish``, which does not wait: what the driver's progress line
and MLflow see. ``collect`` builds one report's metrics, for its own events and for the
checkpoint callback's: train metrics and throughput if steps ran since the last report, val
metrics once per validation, the score Ray ranks checkpoints by, how long the last
checkpoint held training up, rank 0's startup times (once) and system samples, and the
global batch (``global_batch``: the same before and after a resize with
``scaling.keep_global_batch``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger

from raytrain._compat.lightning import epoch_cut_short, epoch_in_progress
from raytrain.checkpoints.layout import checkpoint_score
from raytrain.contract import Publish, Report, Startup
from raytrain.worker.schedule import CheckpointSchedule
from raytrain.worker.system_metrics import SystemMetrics

if TYPE_CHECKING:
    from argparse import Namespace


def scalar_metrics(trainer: pl.Trainer) -> dict[str, float]:
    """Lightning's ``callback_metrics`` that are numbers, as floats."""
    out = {}
    for key, value in trainer.callback_metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def monitor_missing(monitor: str, known: dict[str, float], validated: bool) -> list[str] | None:
    """Whether ``checkpoint.monitor`` can be judged missing yet: None before the first
    validation's metrics are known (``validated``) unless ``monitor`` is already among
    ``known``; then [] when it is there, else the sorted keys that were reported instead."""
    if monitor in known:
        return []
    if not validated:
        return None
    return sorted(k for k in known if not k.startswith("_"))


def batch_rows(batch: Any) -> int:
    """How many samples a batch holds: a dict of columns, a tuple or list of them (``x, y =
    batch``), or a tensor."""
    if isinstance(batch, dict) and batch:
        return batch_rows(next(iter(batch.values())))
    if isinstance(batch, tuple | list) and batch:
        return batch_rows(batch[0])
    try:
        return len(batch)
    except TypeError:
        return 0


def stop_reason(trainer: pl.Trainer) -> str | None:
    """Why a callback stopped training before its limits, or None: an EarlyStopping's
    ``stopping_reason_message``, else that ``trainer.should_stop`` was set."""
    if not trainer.should_stop:
        return None
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        message = getattr(callback, "stopping_reason_message", None)
        if message:
            return f"{type(callback).__name__}: {message}"
    return f"stopped at step {trainer.global_step} by a callback (trainer.should_stop)"


class Ranking:
    """What Ray ranks a report's checkpoint by: the newest value of ``monitor`` (in
    ``mode``), and once, the first validation's keys when ``monitor`` is not among them."""

    def __init__(self, monitor: str | None, mode: str):
        self.monitor, self.mode = monitor, mode
        self._score: float | None = None
        self._checked = False

    def rank(
        self, metrics: dict[str, float], values: dict[str, float], validated: bool
    ) -> tuple[float | None, tuple[str, ...] | None]:
        """The score of a report of ``metrics`` (None: no monitor), and the keys seen when
        the monitored metric is missing (once; None otherwise). ``values``: every metric
        known; ``validated``: a validation has ended."""
        if not self.monitor:
            return None, None
        if self.monitor in metrics:
            self._score = metrics[self.monitor]
        said = None
        if not self._checked:
            missing = monitor_missing(self.monitor, values, validated=validated)
            if missing is not None:
                self._checked = True
                said = tuple(missing) if missing else None
        # A checkpoint taken before the monitored metric was first seen carries the worst
        # finite score, so it never displaces a scored one (and Ray's snapshot keeps it).
        return checkpoint_score(self._score, self.mode), said


class StartupTimes:
    """A worker group's ``Startup`` as rank 0 completes it: the fit's start, the step it
    resumed at, the first step's end; taken once, with the first report after that."""

    def __init__(self, begun: Startup | None):
        self._begun = begun or Startup(marks={}, resumed_step=0, precision="")
        self._marks: dict[str, float] | None = dict(self._begun.marks)
        self._resumed_step = 0

    def mark(self, phase: str) -> None:
        """``phase`` was reached now (the first time only)."""
        if self._marks is not None and phase not in self._marks:
            self._marks[phase] = time.time()

    def resumed(self, step: int) -> None:
        """The trainer is restored by now, at ``step``."""
        self._resumed_step = step

    def take(self) -> Startup | None:
        """The startup, once its first step has ended; then never again."""
        if self._marks is None or "first_step" not in self._marks:
            return None
        marks, self._marks = self._marks, None
        return replace(self._begun, marks=marks, resumed_step=self._resumed_step)


class ValidationKeys:
    """The metrics a validation logs. Lightning keeps the last validation's values in
    ``callback_metrics`` for the rest of the run; they are reported only once, from the
    report right after the validation."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self._before: set[str] = set()
        self._fresh = False
        self.validated = False  # a validation (not the sanity check) has ended

    def started(self, known: set[str]) -> None:
        self._before = known

    def ended(self, known: set[str]) -> None:
        self.keys |= known - self._before
        self._fresh = self.validated = True

    @property
    def unreported(self) -> bool:
        return self._fresh

    def take(self, values: dict[str, float]) -> dict[str, float]:
        """The last validation's values if no report has carried them yet, else nothing."""
        if not self._fresh:
            return {}
        self._fresh = False
        return {k: values[k] for k in self.keys if k in values}


class TrainWindow:
    """The rows trained since the last report and the time they took: throughput, over
    every data-parallel replica (``readers_per_row`` ranks read each row: a tensor-parallel
    group), with the global batch and ``system``'s samples."""

    def __init__(
        self, system: SystemMetrics | None, global_batch: int | None, readers_per_row: int
    ):
        self.system, self.global_batch = system, global_batch
        self.readers_per_row = readers_per_row
        self.rows = 0
        self._start = time.perf_counter()

    def open(self) -> None:
        self.rows, self._start = 0, time.perf_counter()

    def close(self, trainer: pl.Trainer) -> dict[str, float]:
        """The window's throughput (and system samples); the next window opens."""
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        replicas = trainer.world_size // self.readers_per_row
        out = {"samples_per_s": self.rows * replicas / elapsed}
        if self.global_batch is not None:
            out["global_batch"] = self.global_batch
        if self.system is not None:
            out.update(self.system.sample(trainer.global_step))
        self.open()
        return out


class MetricsReporter(pl.Callback):
    """Builds and publishes a worker's reports (see the module docstring)."""

    def __init__(
        self,
        *,
        log_every_n_steps: int,
        schedule: CheckpointSchedule,
        monitor: str | None = None,
        mode: str = "min",
        publish: Publish | None = None,
        startup: Startup | None = None,
        system: SystemMetrics | None = None,
        global_batch: int | None = None,
        readers_per_row: int = 1,
    ):
        """``publish`` receives rank 0's metric events; None on the other ranks.
        ``system`` adds its ``system/...`` metrics to each report of training steps.
        ``startup``: the worker's startup so far (its phases' wall-clock times, the
        precision); it goes out with the first report, completed with the fit's start, the
        first step's end and the step the fit resumed at.
        ``global_batch``: the samples of an optimizer step, reported with the train metrics
        (None: the user's loaders decide the batch). ``readers_per_row``: ranks that read
        each row (a tensor-parallel group), so throughput counts every row once."""
        self.log_every_n_steps = log_every_n_steps
        self.schedule = schedule
        self.ranking = Ranking(monitor, mode)
        self.publish_to = publish
        self.window = TrainWindow(system, global_batch, readers_per_row)
        self.startup = StartupTimes(startup)
        self._blocked_s: float | None = None  # the last checkpoint's hold-up, sent once
        # checkpoint.every_n_steps: auto's interval as a checkpoint left it, and when it
        # changed, what chose it; each sent once
        self.checkpoint_interval: int | None = None
        self.interval_choice: str | None = None
        self.memory_choice: str | None = None  # memory_every_n_steps: auto's, sent once
        self._last_step = -1
        self._last_report_step = -1
        self.validation = ValidationKeys()
        # What Lightning's loggers were given that callback_metrics lacks (a callback's
        # log_metrics, e.g. LearningRateMonitor's): ``ReportLogger`` puts it here.
        self.logged: dict[str, float] = {}

    # -- Lightning hooks -------------------------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.startup.mark("fit_started")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        self.startup.resumed(trainer.global_step)  # restored by now: where the group resumed
        self.window.open()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.startup.mark("first_step")
        self.window.rows += batch_rows(batch)
        step = trainer.global_step
        if step == self._last_step:  # still accumulating gradients
            return
        self._last_step = step
        if not self.schedule.at_step(step) and step % self.log_every_n_steps == 0:
            self.publish(self.collect(trainer, "step"))

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.validation.started(set(trainer.callback_metrics))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validation.ended(set(trainer.callback_metrics))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if epoch_cut_short(trainer):  # not an epoch's end: the run's end reports it
            return
        if not self.schedule.at_epoch(trainer.current_epoch + 1):
            self.publish(self.collect(trainer, "epoch"))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        why = stop_reason(trainer)
        if why is not None:
            self.publish(
                Report(
                    step=trainer.global_step,
                    epoch=epoch_in_progress(trainer),
                    kind="stopped",
                    world_size=trainer.world_size,
                    stopped=why,
                )
            )

    # -- reports ---------------------------------------------------------------------------

    def checkpoint_blocked(self, seconds: float) -> None:
        """How long the last checkpoint held training up; sent with the next report."""
        self._blocked_s = seconds

    def publish_unreported_validation(self, trainer: pl.Trainer) -> None:
        """Publish the run's end if the last validation is in no report yet: one run after
        the step's checkpoint, on the batch that ended an epoch ``max_steps`` cut short
        (which reports no epoch end)."""
        if self.validation.unreported:
            self.publish(self.collect(trainer, "end"))

    def publish(self, report: Report) -> None:
        """Send ``report`` to the driver (rank 0 only; a no-op elsewhere)."""
        if self.publish_to is not None:
            self.publish_to(report)

    def collect(self, trainer: pl.Trainer, kind: str) -> Report:
        """This report (see the module docstring); ``kind`` says what made it. What it
        says once (a checkpoint's hold-up, an interval chosen, the startup) is sent here
        and not again."""
        values = scalar_metrics(trainer)
        metrics: dict[str, float] = {}
        if trainer.global_step != self._last_report_step:
            metrics.update(self._train_window(trainer, values))
        metrics.update(self.validation.take(values))
        if self._blocked_s is not None:
            metrics["checkpoint_blocked_s"] = self._blocked_s
        if self.checkpoint_interval is not None:
            metrics["checkpoint_interval"] = self.checkpoint_interval
        score, missing = self.ranking.rank(metrics, values, self.validation.validated)
        report = Report(
            step=trainer.global_step,
            epoch=epoch_in_progress(trainer),
            kind=kind,
            world_size=trainer.world_size,
            metrics=metrics,
            score=score,
            startup=self.startup.take(),
            checkpoint_interval=self.interval_choice,
            memory_interval=self.memory_choice,
            monitor_missing=missing,
        )
        self._blocked_s = self.checkpoint_interval = None
        self.interval_choice = self.memory_choice = None
        return report

    def _train_window(self, trainer: pl.Trainer, values: dict[str, float]) -> dict[str, float]:
        """Train metrics, throughput and system samples since the last report; opens the
        next window."""
        out: dict[str, float] = {k: v for k, v in self.logged.items() if k not in values}
        out.update({k: v for k, v in values.items() if k not in self.validation.keys})
        self.logged = {}
        out.update(self.window.close(trainer))
        self._last_report_step = trainer.global_step
        return out


class ReportLogger(Logger):
    """A Lightning logger whose metrics join the reporter's next report: what callbacks
    write to the Trainer's loggers (LearningRateMonitor refuses a Trainer without one)
    reaches MLflow with the rest. Rank 0's is the one that reports."""

    def __init__(self, reporter: MetricsReporter):
        super().__init__()
        self._reporter = reporter

    @property
    def name(self) -> str:
        return "raytrain"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            try:
                self._reporter.logged[key] = float(value)
            except (TypeError, ValueError):
                continue

    def log_hyperparams(
        self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any
    ) -> None:
        pass  # the spec is the run's params, logged by the driver
