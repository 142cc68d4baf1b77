"""What a run records beside its checkpoints: the run-state file and the MLflow run.

``RunRecord.start`` starts opening both in a background thread, so MLflow's setup (its
import, a SQLite schema or a server round trip) runs while Ray Train starts the workers
instead of before. Events that arrive first wait for it. If it fails, ``on_error`` is called
(the launcher aborts training) and the error is re-raised wherever the record is used.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import yaml

from raytrain.contract import Report, RollbackNotice, RunListener
from raytrain.driver.background import Background
from raytrain.driver.model_log import ModelLog
from raytrain.errors import RunPreempted, TrackingError
from raytrain.records import runstate
from raytrain.spec import JobSpec
from raytrain.util.redaction import redact, redact_tree

if TYPE_CHECKING:
    from raytrain.tracking.mlflow_tracker import MlflowTracker


def spec_yaml(job: JobSpec) -> str:
    """The resolved spec as the run's ``spec.yaml`` artifact holds it: credentials masked
    (a credential-like field keeps its name, its value is ``***``); no ``tune`` key unless
    it sweeps (as ``dump_spec``)."""
    exclude = {"tune"} if job.tune is None else None
    return yaml.safe_dump(
        redact_tree(job.model_dump(mode="json", exclude=exclude)), sort_keys=False
    )


def tracking_error(tracking_uri: str, exc: BaseException) -> TrackingError:
    """The error for a tracking store that cannot be opened: the URI once, redacted (MLflow's
    own message repeats it, user info and all, in the URL it requested)."""
    detail = str(exc)
    for form in {tracking_uri, tracking_uri.rstrip("/")} - {""}:
        detail = detail.replace(form, "")
    return TrackingError(
        "tracking.mlflow.tracking_uri: cannot open an MLflow run at "
        f"{redact(tracking_uri)}: {type(exc).__name__}: {redact(detail)}"
    )


def monitor_missing(monitor: str | None, reported: Sequence[str]) -> str:
    """What to say when ``checkpoint.monitor`` was not among the first validation's metrics
    (``reported``): checkpoints are ranked by recency until it appears."""
    return (
        f"checkpoint.monitor {monitor!r} was not reported by the first validation "
        f"(reported: {', '.join(reported) or 'nothing'}); checkpoints are ranked by "
        "recency until it is"
    )


class RunRecord(RunListener):
    """The run's state file and MLflow run (see module docstring); it hears rank 0's
    reports and rollbacks, and records them."""

    def __init__(
        self, job: JobSpec, state: runstate.RunState | None, *, close_on_failure: bool = True
    ):
        self.job = job
        self.state = state or runstate.new_state(job)
        self.tracking_uri = ""
        self.opened_at: float | None = None  # wall clock, once open
        self.resumed_from: str | None = None  # the checkpoint this attempt starts from
        self._opening: Background | None = None
        self._group_starts = 0  # worker groups started in this attempt (restarts + 1)
        self.close_on_failure = close_on_failure  # a failed run's exit closes its MLflow run
        self.finished = False  # ``finish`` was called
        self.model = ModelLog(job, self.tracker)

    def start(self, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Start opening the run's records in the background; see :meth:`tracker`."""
        self._opening = Background(lambda: self._open(on_error))

    def _open(self, on_error: Callable[[BaseException], None] | None) -> MlflowTracker:
        try:
            from raytrain.tracking.mlflow_tracker import (
                MlflowTracker,
                default_tracking_uri,
                redacted_params,
            )

            job, state = self.job, self.state
            state.attempts += 1
            state.spec, state.spec_digest = job.flat(), job.digest()
            self.tracking_uri = job.tracking.mlflow.tracking_uri or default_tracking_uri()
            try:
                tracker, _ = MlflowTracker.open(job, self.tracking_uri, state.mlflow_run_id)
            except Exception as exc:
                raise tracking_error(self.tracking_uri, exc) from exc
            state.mlflow_run_id, state.tracking_uri, state.status = (
                tracker.run_id,
                self.tracking_uri,
                "RUNNING",
            )
            runstate.save(job, state)
            tracker.log_params(redacted_params(job.flat()))
            started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            tracker.set_tags(
                {
                    "raytrain.attempts": str(state.attempts),
                    f"raytrain.attempt.{state.attempts}": f"started {started}, "
                    f"from {self.resumed_from or 'the start'}",
                }
            )
            tracker.log_text(spec_yaml(job), "spec.yaml")
            self.opened_at = time.time()
            return tracker
        except BaseException as exc:
            if on_error is not None:
                on_error(exc)
            raise

    def tracker(self) -> MlflowTracker:
        """The open ``MlflowTracker``; waits for it, and raises what opening it raised."""
        assert self._opening is not None, "RunRecord.start() was not called"
        return self._opening.result()

    def on_report(self, report: Report) -> None:
        """Log a report's numbers at its step, and what it says of the run in tags. A
        report that opens a worker group (it carries the group's ``Startup``) after the
        first is a restart: it is counted on the run (``raytrain.restarts``, across
        attempts) and described."""
        tracker = self.tracker()
        step = report.step
        self.model.preload()  # what logging the model at the end imports, from now on
        if report.startup is not None:
            self._group_starts += 1
            tracker.set_tags({"raytrain.precision": report.startup.precision})
            if self._group_starts > 1:
                self.state.restarts += 1
                tracker.set_tags(
                    {
                        "raytrain.restarts": str(self.state.restarts),
                        f"raytrain.restart.{self.state.restarts}": (
                            f"attempt {self.state.attempts}: workers restarted, "
                            f"{report.world_size} of them, resumed at step "
                            f"{report.startup.resumed_step}, first report at step {step}"
                        ),
                    }
                )
        if report.monitor_missing is not None:
            # said once: checkpoints are ranked by recency until it appears
            said = monitor_missing(self.job.checkpoint.monitor, report.monitor_missing)
            print(f"raytrain: warning: {said}", file=sys.stderr)
            tracker.set_tags({"raytrain.checkpoint_ranking": said})
        for text, tag in (
            (report.checkpoint_interval, "raytrain.checkpoint_interval"),  # auto chose anew
            (report.memory_interval, "raytrain.memory_interval"),
        ):
            if text is not None:
                print(f"raytrain: at step {step}: {text}", file=sys.stderr)
                tracker.set_tags({tag: text})
        if report.stopped is not None:
            print(f"raytrain: stopped early at step {step}: {report.stopped}", file=sys.stderr)
            tracker.set_tags({"raytrain.stopped": report.stopped})
        tracker.log_metrics(report.values(), step=step)

    def on_rollback(self, notice: RollbackNotice) -> None:
        """Rank 0's rollback past a spike (``worker.spike``): stderr, and MLflow's
        ``raytrain.rollbacks`` count, a tag per rollback and the ``rollbacks.json``
        artifact (the run folder's record as it stands)."""
        count = len(notice.rollbacks)
        line = notice.rollbacks[-1].describe()
        print(f"raytrain: rollback {count}: {line}", file=sys.stderr)
        tracker = self.tracker()
        tracker.set_tags({"raytrain.rollbacks": str(count), f"raytrain.rollback.{count}": line})
        entries = [rollback.to_json() for rollback in notice.rollbacks]
        tracker.log_text(json.dumps(entries, indent=1), "rollbacks.json")

    def __enter__(self) -> RunRecord:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        """A failed run closes its MLflow run ``FAILED`` (``KILLED``: Ctrl-C, ``RunPreempted``)
        unless ``close_on_failure`` is off (a sweep's trial: its driver knows why)."""
        if exc is not None and self.close_on_failure and not self.finished:
            killed = isinstance(exc, KeyboardInterrupt | RunPreempted)
            self.finish("KILLED" if killed else "FAILED", error=str(exc))

    def finish(self, status: str, *, error: str | None = None, best: str | None = None) -> None:
        """Close the MLflow run with ``status`` and save the state; nothing if opening failed
        or never started."""
        self.finished = True
        if self._opening is None:
            return
        try:
            tracker = self._opening.result()
        except BaseException:
            return
        if best is not None:
            tracker.set_tags({"raytrain.best_checkpoint": best})
        note = tracker.metrics_note(finished=status == "FINISHED")
        if note:  # the run's metrics lost or never reported: said, and kept on the run
            print(f"raytrain: warning: {note}", file=sys.stderr)
            tracker.set_tags({"raytrain.metrics_note": note})
        tracker.finish(status, error=error)
        self.state.status = "FINISHED" if status == "FINISHED" else "FAILED"
        runstate.save(self.job, self.state)
