"""The driver's writer of the run's live status record (``raytrain.records.run_status``).

``StatusRecord`` is a listener of the run's events (beside MLflow and the progress line):
each report moves the record on (step, epoch, throughput, ETA, the last validation, the
world size), a report that opens a new worker group is a restart (with the reason the
failure policy sent ahead of it), and a checkpoint's report puts the run in
``checkpointing`` until Ray's snapshot shows it committed. The record is written at most
every ``WRITE_EVERY_S`` on reports, at once on a change of state, and at least every
``run_status.HEARTBEAT_S`` by a heartbeat thread, so that its age tells a reader whether the
driver lives. A write that fails (the store is down) is said once on stderr and never stops
training: the record is a view, the checkpoints are the truth.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable

from raytrain import storage
from raytrain.checkpoints.layout import latest_committed, number, run_dir
from raytrain.contract import FailureNotice, Report, RunListener
from raytrain.errors import (
    LossSpikeLimitError,
    ModelNotRegistered,
    NonFiniteLossError,
    RaytrainError,
    RunPreempted,
    TrainingFailed,
    wraps,
)
from raytrain.records import run_status
from raytrain.records.run_status import CheckpointMark, FailureKind, Restart, RunStatus, State
from raytrain.spec import JobSpec

WRITE_EVERY_S = 2.0


# What a worker's failure reads as when no user code raised: its process or node went
# (Ray Train's failed or timed-out health check of a worker, which carries Ray's error for
# a dead actor, a killed or OOM-killed worker, a lost node; a hang watchdog's exit), or a
# preemption's budget ran out.
INFRASTRUCTURE_MARKERS = (
    "WorkerHealthCheckFailedError",
    "WorkerHealthCheckTimeoutError",
    "ActorDiedError",
    "ActorUnavailableError",
    "NodeDiedError",
    "WorkerCrashedError",
    "OutOfMemoryError",
    "RaySystemError",
    "PreemptedError",
    "died without raising",
    "died unexpectedly",
    "exit code 70",
)


def failure_kind(error: BaseException) -> FailureKind:
    """The kind of the error a driver ended with (``run_status.FailureKind``). A NaN stop or
    a spent spike budget is told by the worker's exception, or its name in the error's
    lines: a worker's exception reaches the driver as text inside Ray's. Workers that
    failed only by dying (every line one of ``INFRASTRUCTURE_MARKERS``) are
    ``infrastructure``: a supervisor submits the run again; any other worker failure is
    the user's code (``workers``)."""
    problems = getattr(error, "problems", None) or [str(error)]

    def named(kind: type[BaseException]) -> bool:
        return wraps(error, kind) or any(kind.__name__ in line for line in problems)

    if named(NonFiniteLossError):
        return "non_finite"
    if named(LossSpikeLimitError):
        return "spike_limit"
    if isinstance(error, RunPreempted):
        return "preempted"
    if isinstance(error, TrainingFailed):
        died = all(any(m in line for m in INFRASTRUCTURE_MARKERS) for line in problems)
        return "infrastructure" if died else "workers"
    if isinstance(error, RaytrainError) and error.exit_code == 2:
        return "bad_input"
    if isinstance(error, KeyboardInterrupt | SystemExit):
        return "interrupted"
    return "driver"


def eta(
    first: tuple[float, int] | None, now: float, step: int, total: int | None, last: float | None
) -> float | None:
    """Seconds to ``total`` steps at the rate since ``first`` (when, at which step, the
    worker group's first report came); None before it or with no total; ``last`` (the
    previous estimate) while no step or time has passed since it."""
    if first is None or not total:
        return None
    t0, s0 = first
    if step <= s0 or now <= t0:
        return last
    return max(0.0, (total - step) * (now - t0) / (step - s0))


def read_committed(job: JobSpec) -> tuple[int, int] | None:
    """The (step, epoch) of the run's latest committed checkpoint (Ray's snapshot), or None."""
    latest = latest_committed(run_dir(job), job.storage)
    if latest is None:
        return None
    metrics = latest[1]
    return int(metrics.get("step", 0)), int(metrics.get("epoch", 0))


class CommitWatch:
    """A checkpoint reported (``pending``: its step and epoch) until Ray's snapshot shows it
    committed. ``committed`` reads the latest committed checkpoint's (step, epoch)."""

    def __init__(self, committed: Callable[[], tuple[int, int] | None]):
        self._committed = committed
        self.pending: tuple[int, int] | None = None

    def check(self) -> tuple[int, int] | None:
        """The committed (step, epoch) once it reaches the pending checkpoint (nothing is
        pending then); None before, and while nothing is pending (the snapshot is read only
        then). A read that fails is None too: asked again at the next event or heartbeat."""
        if self.pending is None:
            return None
        try:
            committed = self._committed()
        except Exception:
            return None
        if committed is None or committed[0] < self.pending[0]:
            return None
        self.pending = None
        return committed

    def settle(self, status: RunStatus, now: float) -> None:
        """Once the pending checkpoint shows committed: ``status``'s last checkpoint, and
        the run back to ``training``."""
        committed = self.check()
        if committed is None:
            return
        step, epoch = committed
        status.last_checkpoint = CheckpointMark(step=step, epoch=epoch, at=now)
        if status.state == "checkpointing":
            status.state = "training"


class RestartLog:
    """Why and where the workers restarted: the failure policy's notice (with the hang
    reported before it, if one was), the last step reported before it, and the next worker
    group's first report."""

    def __init__(self) -> None:
        self.groups = 0  # worker groups that reported
        self.failure: str | None = None  # the last failure the policy saw
        self.hang: str | None = None  # a hang reported since the workers last started
        self.failed_at = 0  # the last step reported before that failure

    def failed(self, text: str, step: int) -> None:
        self.failure = f"{self.hang} ({text})" if self.hang else text
        self.hang = None  # a later failure is its own
        self.failed_at = step

    def started(self, report: Report, now: float) -> Restart | None:
        """A worker group's first report (it carries the group's ``Startup``): after the
        first group's, its restart, from the step the trainer restored (from memory or
        storage)."""
        assert report.startup is not None
        self.groups += 1
        restart = None
        if self.groups > 1:
            start = report.startup.resumed_step
            restart = Restart(
                at=now,
                step=start,
                reason=self.failure or "the workers were restarted",
                world_size=report.world_size,
                lost_steps=max(0, self.failed_at - start),
            )
        self.failure, self.hang = None, None
        return restart


def advance(status: RunStatus, report: Report, now: float, first: tuple[float, int]) -> None:
    """Move ``status`` on by ``report`` of rank 0, made at ``now``: the step and epoch, the
    world size, throughput, the last validation, a callback's stop, the total steps (once
    an epoch's length is known) and the ETA at the rate since ``first`` (the time and step
    of this worker group's first report)."""
    step = report.step
    status.step, status.epoch = step, report.epoch
    status.world_size = report.world_size
    if (rate := number(report.metrics.get("samples_per_s"))) is not None:
        status.samples_per_s = rate
    vals = {k: float(v) for k, v in report.metrics.items() if k.startswith("val")}
    if vals:
        status.val_metrics = vals
    if report.stopped is not None:
        status.stopped = report.stopped
    if report.kind in ("epoch", "end") and not status.total_steps and step:
        epochs = max(report.epochs_done, 1)
        if status.max_epochs and status.max_epochs > 0:
            status.total_steps = round(step / epochs * status.max_epochs)
    status.eta_s = eta(first, now, step, status.total_steps, status.eta_s)


class RecordWriter:
    """Writes the record's text to ``path`` (``write``: to the run's storage): at most every
    ``WRITE_EVERY_S`` unless forced. A write that fails is said once on stderr and never
    raised: the record is a view, training goes on without it."""

    def __init__(self, path: str, write: Callable[[str], None]):
        self.path, self._write = path, write
        self.written_at: float | None = None
        self._warned = False

    def due(self, now: float, force: bool) -> bool:
        recent = self.written_at is not None and now - self.written_at < WRITE_EVERY_S
        return force or not recent

    def write(self, text: str, now: float) -> None:
        self.written_at = now
        try:
            self._write(text)
        except Exception as exc:
            if not self._warned:
                self._warned = True
                print(
                    f"raytrain: warning: the status record {self.path} could not be "
                    f"written ({storage.describe(exc)}); training goes on",
                    file=sys.stderr,
                )


def first_status(job: JobSpec, attempt: int, now: float) -> RunStatus:
    """The record as an attempt of ``job`` starts, driven from this process."""
    max_steps = job.trainer.max_steps
    return RunStatus(
        name=job.name,
        state="starting",
        started_at=now,
        updated_at=now,
        driver=f"{socket.gethostname()}:{os.getpid()}",
        attempt=attempt,
        max_epochs=job.trainer.max_epochs,
        total_steps=max_steps if max_steps and max_steps > 0 else None,
    )


class StatusRecord(RunListener):
    """The run's status record, kept from its events (see the module docstring).

    ``clock`` and ``write`` are parameters so that a unit test can drive it event by event
    without a store; ``committed`` reads the run's latest committed checkpoint (step,
    epoch) or None."""

    def __init__(
        self,
        job: JobSpec,
        *,
        attempt: int = 1,
        clock: Callable[[], float] = time.time,
        write: Callable[[str], None] | None = None,
        committed: Callable[[], tuple[int, int] | None] | None = None,
        mlflow_run: Callable[[], str | None] = lambda: None,
    ):
        self.job = job
        self.path = path = run_status.status_path(run_dir(job))
        self._clock = clock
        self._writer = RecordWriter(
            path, write or (lambda text: storage.write_text(path, text, job.storage))
        )
        self._commits = CommitWatch(committed or (lambda: read_committed(job)))
        self._mlflow_run = mlflow_run  # known once the run's records are open
        self.status = first_status(job, attempt, clock())
        self._lock = threading.Lock()
        self._first: tuple[float, int] | None = None  # (time, step) of this attempt's first
        self._restarts = RestartLog()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # -- the record's life -----------------------------------------------------------------

    def __enter__(self) -> StatusRecord:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        """The last record, by how the run ended: ``finished`` (a model trained but not
        registered too), else ``failed`` with the error and its kind."""
        if exc is None or isinstance(exc, ModelNotRegistered):
            self.finish("finished")
        else:
            self.finish("failed", error=str(exc) or type(exc).__name__, failure=failure_kind(exc))

    def start(self) -> None:
        """Write the first record and start the heartbeat."""
        self._save(force=True)
        self._beat = threading.Thread(target=self._heartbeat, name="raytrain-status", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(run_status.HEARTBEAT_S, 10.0)):
            with self._lock:
                self._commits.settle(self.status, self._clock())
                written = self._writer.written_at or 0.0
                due = self._clock() - written >= run_status.HEARTBEAT_S
            if due:
                self._save(force=True)

    def finish(
        self, state: State, *, error: str | None = None, failure: FailureKind | None = None
    ) -> None:
        """The last record: ``finished`` or ``failed`` (with the error and its kind, which a
        supervisor reads to tell the run's own verdict from a lost driver); the heartbeat
        ends."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        with self._lock:
            self.status.state = state
            self.status.error = error
            self.status.failure = failure
            if state == "finished":
                self.status.eta_s = None
            self._commits.settle(self.status, self._clock())
        self._save(force=True)

    def note_hang(self, summary: str) -> None:
        """A hang the ranks reported (``driver.hangs``): the reason of the restart after it."""
        with self._lock:
            self.status.hang = self._restarts.hang = summary
        self._save(force=True)

    def set_straggler(self, text: str | None) -> None:
        """The rank holding the others up (``driver.timeline``), or None once it caught up."""
        with self._lock:
            changed = self.status.straggler != text
            self.status.straggler = text
        self._save(force=changed)

    # -- events ----------------------------------------------------------------------------

    def on_failure(self, notice: FailureNotice) -> None:
        """The failure policy's notice: the failed group reports nothing more, the new one
        has not started."""
        with self._lock:
            before = self.status.state
            self._restarts.failed(notice.text, self.status.step)
            self.status.state = "restarting"
        self._save(force=before != "restarting")

    def on_report(self, report: Report) -> None:
        """A report from rank 0."""
        with self._lock:
            changed = self._apply(report)
        self._save(force=changed)

    def _apply(self, report: Report) -> bool:
        """Move the record on by ``report``; whether its state changed."""
        status, before = self.status, self.status.state
        now, step = self._clock(), report.step
        if report.startup is not None:  # a new worker group: its rate counts anew
            restart, self._first = self._restarts.started(report, now), None
            status.restarts += [restart] if restart is not None else []
        if self._first is None:
            self._first = (now, step)
            if status.first_report_at is None:
                status.first_report_at = now
        advance(status, report, now, self._first)
        if report.checkpoint:
            self._commits.pending = (step, status.epoch)
            status.state = "checkpointing"
        elif status.state in ("starting", "restarting"):
            status.state = "training"
        self._commits.settle(self.status, self._clock())
        return status.state != before

    # -- writing ---------------------------------------------------------------------------

    def _save(self, *, force: bool) -> None:
        with self._lock:
            now = self._clock()
            if not self._writer.due(now, force):
                return
            self.status.updated_at = now
            self.status.mlflow_run_id = self._mlflow_run() or self.status.mlflow_run_id
            # under the lock: an older record never lands last
            self._writer.write(self.status.to_json(), now)
