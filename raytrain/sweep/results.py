"""What a sweep returns: the best trial and a row per trial."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TrialRow:
    """One trial: its run's name, how it ended, its sampled values and last metrics."""

    name: str
    status: str  # "finished", "stopped" (by the scheduler) or "error"
    values: dict[str, Any]
    metrics: dict[str, Any]
    epochs: int
    mlflow_run_id: str | None = None
    error: str | None = None
    checkpoint: str | None = None  # its best checkpoint, as the trial reported it

    def score(self, metric: str) -> float | None:
        value = self.metrics.get(metric)
        if not isinstance(value, int | float) or isinstance(value, bool):
            return None
        return float(value) if math.isfinite(value) else None


@dataclass
class SweepResult:
    """The sweep's outcome: its best trial (by ``metric`` and ``mode``) and every trial."""

    name: str
    metric: str
    mode: str
    best: TrialRow | None
    best_spec_path: str | None  # a plain spec of the best trial, for `raytrain run`
    best_checkpoint_uri: str | None
    trials: list[TrialRow]
    mlflow_run_id: str  # the sweep's parent run
    tracking_uri: str
    sweep_dir: str
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def best_metrics(self) -> dict[str, Any]:
        return dict(self.best.metrics) if self.best else {}

    def table(self) -> list[dict[str, Any]]:
        """The trials, best first: name, status, epochs, the metric, the sampled values."""
        rows = sorted(self.trials, key=lambda r: rank_key(r, self.metric, self.mode))
        return [
            {
                "trial": r.name,
                "status": r.status,
                "epochs": r.epochs,
                self.metric: r.score(self.metric),
                **r.values,
            }
            for r in rows
        ]


def best_first(score: float | None, name: str, mode: str) -> tuple[int, float, str]:
    """The sort key of a trial named ``name`` scoring ``score``: best first by ``mode``
    (``max`` or ``min``), trials without a score last, equal scores by name.

    Every listing of a sweep's trials sorts with this one key, so the summary, ``trials.json``
    and ``raytrain report`` list them in one order: with the score alone, two trials of equal
    val_acc came in the order each source happened to hold them (Tune's, MLflow's)."""
    if score is None:
        return (1, 0.0, name)
    return (0, -score if mode == "max" else score, name)


def rank_key(row: TrialRow, metric: str, mode: str) -> tuple[int, float, str]:
    """Sorts trials best first (``best_first``)."""
    return best_first(row.score(metric), row.name, mode)


def best_of(rows: list[TrialRow], metric: str, mode: str) -> TrialRow | None:
    """The best trial that reported ``metric``; None when none did."""
    scored = [r for r in rows if r.score(metric) is not None]
    return min(scored, key=lambda r: rank_key(r, metric, mode)) if scored else None
