"""What a worker tells the driver: one frozen type per event, and the listener that hears them.

Ray Train hands its report callbacks a typed ``_TrainingReport``; raytrain's events travel
outside ``ray.train.report`` (through the ``MetricsSink`` actor, ``driver.progress``: a
report waits for the controller's poll) and are typed the same way. Workers build these
objects, the sink holds them (pickled, as Ray passes any argument), and the driver's
``ReportPump`` hands each to every ``RunListener`` by its type (``deliver``): no side reads
an event by a string key, so a field one side relies on is checked by the type checker.

- ``Report``: one of rank 0's reports (``worker.reporting``): a step, an epoch's end, the
  run's end, a stop by a callback; the metrics, and what raytrain says of itself beside
  them (a checkpoint, the worker group's ``Startup``, an interval ``auto`` chose).
- ``TimelineWindow``: a rank's step timeline over one report window (``worker.step_timeline``).
- ``HangReport``: a rank's report of a hang (``worker.hang_watchdog``).
- ``RollbackNotice``: rank 0's rollbacks past loss spikes, the run's record as it stands
  (``worker.spike``).
- ``FailureNotice``: the failure policy's word, from Ray Train's controller, on why the
  worker group restarts (``driver.failure_policy``).

``Report.for_ray`` is the one place that builds what ``ray.train.report`` gets with a
checkpoint (Ray keeps it with the checkpoint and ranks by ``SCORE_KEY``). Nothing here
imports Ray, torch or Lightning: both sides import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raytrain.records.rollback_record import Rollback

# The key of ``Report.for_ray``'s dict Ray Train ranks checkpoints by
# (``checkpoint_score_attribute``): the value of ``checkpoint.monitor``.
SCORE_KEY = "_score"


def epochs_done(epoch: int, kind: str) -> int:
    """Epochs completed as of a report of ``epoch`` made by ``kind``: a report at an epoch's
    end (``kind`` "epoch") carries that epoch's 0-based number; any other, the number of
    the epoch it was in."""
    return epoch + (1 if kind == "epoch" else 0)


@dataclass(frozen=True)
class Startup:
    """How a worker group started, as rank 0 saw it; sent once, with its first report.

    A report that carries one opens a worker group: after the run's first, a restart."""

    # phase -> when it was reached (Unix time): worker_started, train_loop_entered,
    # lightning_imported, fit_started, first_step (``driver.results.WORKER_PHASES``)
    marks: Mapping[str, float]
    resumed_step: int  # the step the group's fit resumed at, as the restored trainer holds it
    precision: str  # the precision it trains at, and why: "bf16-mixed (the GPU has bf16)"


@dataclass(frozen=True)
class Report:
    """One of rank 0's reports (``worker.reporting.MetricsReporter``)."""

    step: int  # optimizer steps done
    epoch: int  # the epoch in progress, from 0
    # what made it: "step", "epoch" (its end), "end" (the run's), "stopped" (by a
    # callback), "preemption (...)" (a checkpoint on notice)
    kind: str
    world_size: int
    # every number reported: the user's train and val metrics, samples_per_s, system/...,
    # checkpoint_blocked_s, checkpoint_interval, global_batch
    metrics: Mapping[str, float] = field(default_factory=dict)
    score: float | None = None  # what Ray ranks this report's checkpoint by (monitor set)
    checkpoint: bool = False  # it carries a checkpoint, which Ray commits after it
    startup: Startup | None = None  # the first report of a worker group
    stopped: str | None = None  # why a callback (EarlyStopping) stopped training
    checkpoint_interval: str | None = None  # every_n_steps: auto's new interval, and why
    memory_interval: str | None = None  # memory_every_n_steps: auto's new interval, and why
    # the first validation's keys when checkpoint.monitor was not among them (said once)
    monitor_missing: tuple[str, ...] | None = None

    @property
    def epochs_done(self) -> int:
        """Epochs completed as of this report (``epochs_done``)."""
        return epochs_done(self.epoch, self.kind)

    def values(self) -> dict[str, float]:
        """The report's numbers as one mapping: its metrics, ``epoch`` and ``world_size``
        (what MLflow logs at ``step``, and the newest of which a run ends with), and
        ``step``."""
        return {
            **self.metrics,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.world_size,
        }

    def for_ray(self) -> dict[str, Any]:
        """What ``ray.train.report`` gets with this report's checkpoint: the numbers, and
        ``SCORE_KEY`` when a metric is monitored (Ray keeps both with the checkpoint)."""
        out: dict[str, Any] = {**self.values(), "kind": self.kind}
        if self.score is not None:
            out[SCORE_KEY] = self.score
        return out


@dataclass(frozen=True)
class TimelineWindow:
    """A rank's step timeline over one report window (``worker.step_timeline``)."""

    rank: int
    node: str
    step: int  # the window's last step: every rank's window of a report shares it
    world_size: int
    # each part of a step (data_wait, forward, ..., busy) -> [p50, p90, mean] seconds
    parts: Mapping[str, Sequence[float]]


@dataclass(frozen=True)
class HangReport:
    """One rank's report of a hang: where it was and for how long, and its stacks' file."""

    rank: int
    world_size: int
    node: str
    pid: int
    step: int
    phase: str
    idle_s: float
    allowed_s: float
    collective: str | None  # the collective it waits in; None: it is not in one
    attempt: str  # the attempt's token: its folder of stacks files
    stacks: str  # the stacks file: {run}/hangs/{attempt}/rank{r}.txt
    at: float  # when it was found (Unix time)

    def describe(self) -> str:
        where = f"in {self.collective}" if self.collective else "not in a collective"
        return (
            f"rank {self.rank} (node {self.node}) {where}, in {self.phase} at step "
            f"{self.step}: no batch finished for {self.idle_s:.0f} s (allowed "
            f"{self.allowed_s:.0f} s)"
        )


@dataclass(frozen=True)
class RollbackNotice:
    """Rank 0's rollbacks past loss spikes, oldest first: the run folder's record as it
    stands once the newest one was restored (``worker.spike``)."""

    step: int
    rollbacks: tuple[Rollback, ...]


@dataclass(frozen=True)
class FailureNotice:
    """Why the worker group failed and restarts, in one line: the failure policy's word
    from Ray Train's controller (``driver.failure_policy``)."""

    text: str


Event = Report | TimelineWindow | HangReport | RollbackNotice | FailureNotice
# How a worker sends an event to the driver (``worker.loop``: to the run's sink); a
# rank that sends nothing gets None instead.
Publish = Callable[[Event], None]


class RunListener:
    """Hears a run's events on the driver, one method per event type (Ray Train's
    ``ReportCallback`` shape); each does nothing unless a subclass overrides it. A method
    may raise ``driver.progress.StopRun`` to end the run; any other error is kept and
    training goes on (``ReportPump``)."""

    def on_report(self, report: Report) -> None:
        """One of rank 0's reports."""

    def on_timeline(self, window: TimelineWindow) -> None:
        """A rank's step timeline over a report window."""

    def on_hang(self, report: HangReport) -> None:
        """A rank's report of a hang."""

    def on_rollback(self, notice: RollbackNotice) -> None:
        """Rank 0's rollbacks, the newest just restored."""

    def on_failure(self, notice: FailureNotice) -> None:
        """The worker group failed; it restarts (or the run ends)."""


def deliver(event: Event, listener: RunListener) -> None:
    """Hand ``event`` to the ``listener``'s method for its type."""
    if isinstance(event, Report):
        listener.on_report(event)
    elif isinstance(event, TimelineWindow):
        listener.on_timeline(event)
    elif isinstance(event, HangReport):
        listener.on_hang(event)
    elif isinstance(event, RollbackNotice):
        listener.on_rollback(event)
    elif isinstance(event, FailureNotice):
        listener.on_failure(event)
    else:
        raise TypeError(f"not a run event: {type(event).__name__}")
