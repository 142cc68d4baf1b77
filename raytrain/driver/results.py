"""What a run gives back: ``FitResult``, and how it is read out of Ray Train's result.

Pure functions of Ray's result and the metrics rank 0 reported: the final metrics, the best
of the kept checkpoints (``best_of``), the workers' own errors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raytrain import storage
from raytrain.checkpoints.layout import latest_committed, real_score
from raytrain.contract import SCORE_KEY, Startup
from raytrain.errors import root_cause
from raytrain.records import runstate
from raytrain.spec import JobSpec

if TYPE_CHECKING:
    from ray.train import Checkpoint, Result


@dataclass
class FitResult:
    """What a finished run produced."""

    name: str
    metrics: dict[str, Any]
    best_checkpoint_uri: str | None
    latest_checkpoint_uri: str | None
    mlflow_run_id: str | None
    tracking_uri: str | None
    run_dir: str
    resumed_from: str | None = None
    wall_time_s: float = 0.0
    checkpoints: list[str] = field(default_factory=list)
    # seconds from the start of fit() to the end of each phase (startup breakdown)
    timings: dict[str, float] = field(default_factory=dict)
    # how each split reached the workers: "cached" (object store, read once) or "streamed"
    data_paths: dict[str, str] = field(default_factory=dict)
    # the trained model in MLflow (runs:/... or models:/...), when it was logged
    model_uri: str | None = None
    # the run had trained to its limits already: nothing was started, trained or logged
    already_complete: bool = False
    # why a callback (EarlyStopping) ended training before its limits, if one did
    stopped: str | None = None
    chaos: dict[str, Any] | None = None  # failure.chaos: the faults and what they cost


@dataclass(frozen=True)
class Trained:
    """What the training phase hands back to ``fit``."""

    result: Result
    latest: dict[str, float]  # the newest value of every number rank 0 reported
    data_paths: dict[str, str]  # split -> "cached" | "streamed" | "mixed"
    chaos: dict[str, Any] | None = None  # failure.chaos: the faults and their cost
    startup: Startup | None = None  # the newest worker group's, as rank 0 reported it
    stopped: str | None = None  # why a callback (EarlyStopping) stopped training, if one did


# The startup phases rank 0 reports once (``Startup.marks``, see worker.loop), in order.
WORKER_PHASES = (
    "worker_started",
    "train_loop_entered",
    "lightning_imported",
    "fit_started",
    "first_step",
)


def worker_timings(startup: Startup | None, start: float) -> dict[str, float]:
    """The workers' startup phases, in seconds from ``start``."""
    marks = startup.marks if startup is not None else {}
    return {phase: round(marks[phase] - start, 3) for phase in WORKER_PHASES if phase in marks}


def checkpoint_uri(spec: JobSpec, checkpoint: Checkpoint | None) -> str | None:
    """Where a checkpoint of Ray's result lives, under the spec's run folder."""
    if checkpoint is None:
        return None
    return storage.join(runstate.run_dir(spec), os.path.basename(checkpoint.path.rstrip("/")))


def worker_errors(exc: BaseException) -> list[str]:
    """The workers' own exceptions, not only Ray's wrapper around them."""
    failures = getattr(exc, "worker_failures", None)
    if failures:
        return [f"training failed on rank {rank}: {root_cause(e)}" for rank, e in failures.items()]
    return [f"training failed: {root_cause(exc)}"]


def final_metrics(result: Result, latest: dict[str, Any] | None, job: JobSpec) -> dict[str, Any]:
    """The newest value of every metric reported; a run that trained nothing more (already
    at max_epochs) reports its latest checkpoint's."""
    metrics = dict(latest or {})
    if not metrics:
        committed = latest_committed(runstate.run_dir(job), job.storage)
        metrics = dict(committed[1]) if committed else dict(result.metrics or {})
    return user_metrics(metrics)


def user_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` (a checkpoint's, as Ray keeps them: ``Report.for_ray``) without what
    raytrain adds for itself: every such key begins with ``_`` (``contract.SCORE_KEY``),
    and ``kind``."""
    return {k: v for k, v in metrics.items() if not k.startswith("_") and k != "kind"}


def best_checkpoint(job: JobSpec, result: Result) -> str | None:
    """The URI of the run's best kept checkpoint (see ``best_of``)."""
    entries = result.best_checkpoints or []
    if not entries:
        return checkpoint_uri(job, result.checkpoint)
    return checkpoint_uri(job, best_of(entries, job.checkpoint.monitor, job.checkpoint.mode))


def best_of(entries: list[tuple[Any, dict[str, Any]]], monitor: str | None, mode: str) -> Any:
    """The best of Ray Train's kept checkpoints, (checkpoint, metrics) pairs as Ray keeps
    them (by score, worst first, equal scores in the order reported; with no monitor, in
    the order reported): the best finite score, the newest of equals; with no monitor, or
    no checkpoint scored (the monitored metric was never reported), the newest."""
    sign = 1 if mode == "max" else -1
    best, best_score = entries[-1][0], None
    if not monitor:
        return best
    for checkpoint, metrics in entries:
        score = real_score(metrics.get(SCORE_KEY))
        if score is None:
            continue
        if best_score is None or sign * score >= sign * best_score:
            best, best_score = checkpoint, score
    return best
