"""One trial of a sweep, run by Ray Tune in its trial actor: a whole raytrain run.

The sweep's driver hands every trial one ``TrialPlan``. A trial sets its sampled values
into the plan's base spec, names itself ``{sweep}-{n}`` (n: Tune's trial number, the same
when a sweep resumes), and runs ``launcher.run_job``: its own Ray Train workers, its
checkpoints in ``{sweep folder}/trials``, its MLflow run nested under the sweep's, a rerun
resuming from its last committed checkpoint. Metrics reach Tune from the run's own event
stream on this side (``TuneReporter``, a listener beside MLflow): the workers report
nothing extra.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raytrain.checkpoints.layout import epochs_done, latest_committed, run_dir
from raytrain.contract import Report, RunListener
from raytrain.errors import SpecError

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray.tune.experiment import Trial


# The result keys a trial reports beside its metrics: what the sweep's driver reads back.
TRIAL_NAME = "raytrain_trial"
BEST_CHECKPOINT = "raytrain_best_checkpoint"
MLFLOW_RUN = "raytrain_mlflow_run_id"


@dataclass(frozen=True)
class TrialPlan:
    """What every trial gets from the sweep's driver (Tune pickles it to each trial)."""

    base: dict[str, Any]  # the spec's tree without `tune`, locations made absolute
    sweep: str  # the sweep's name
    trials_storage: str  # checkpoint.storage of every trial: {sweep folder}/trials
    tracking_uri: str
    experiment: str
    parent_run_id: str
    metric: str
    mode: str
    time_attr: str  # "epoch" or "step": what the scheduler counts
    cwd: str  # the driver's directory: a relative path in the user's code means the same
    tags: dict[str, str] = field(default_factory=dict)  # on every trial's run (the job id)
    # The environment of the embedded cluster the sweep's driver started; None when the
    # sweep joined a cluster.
    embedded_env: dict[str, str] | None = None
    # Each choice and grid field's values: Tune's config holds indices into them
    # (``space.param_space``), so that no listed value lands in Tune's files.
    listed: dict[str, list[Any]] = field(default_factory=dict)


def trial_name(sweep: str, trial_id: str) -> str:
    """``{sweep}-{n}``, n from Tune's trial id (``<experiment>_<n:05d>``)."""
    return f"{sweep}-{int(trial_id.rsplit('_', 1)[-1]):03d}"


def tune_trial_name(sweep: str, trial: Trial) -> str:
    """A trial's name and folder name in Ray Tune (``TuneConfig``'s creators): its
    raytrain name. Tune's default holds the sampled values."""
    return trial_name(sweep, trial.trial_id)


def trial_values(plan: TrialPlan, config: dict[str, Any], name: str) -> dict[str, Any]:
    """The fields a trial sets in the base spec: its sampled values (from Tune's
    ``config``: ``space.values_of``), then where it keeps its checkpoints, the sweep's
    metric as its checkpoints' ranking, and its MLflow run's place under the sweep's
    (``spec.tune.RESERVED_FIELDS``: a sweep may not sample these)."""
    from raytrain.sweep.space import values_of

    config = values_of(config, plan.listed)
    tags = {
        **plan.base.get("tracking", {}).get("mlflow", {}).get("tags", {}),
        **plan.tags,
        "mlflow.parentRunId": plan.parent_run_id,
        "raytrain.sweep": plan.sweep,
        "raytrain.trial": name,
        **{f"raytrain.sampled.{key}": str(value) for key, value in config.items()},
    }
    return {
        **config,
        "checkpoint.storage": plan.trials_storage,
        "checkpoint.monitor": plan.metric,
        "checkpoint.mode": plan.mode,
        "tracking.mlflow.tracking_uri": plan.tracking_uri,
        "tracking.mlflow.experiment": plan.experiment,
        "tracking.mlflow.tags": tags,
    }


class TuneReporter(RunListener):
    """A listener of the trial's events: each report that carries the sweep's metric goes
    to Tune, with ``epoch`` as epochs completed and ``step``, except the one at the trial's
    end (``end``, counted in ``time_attr``): a scheduler may stop a trial at any result it
    gets, and one stopped there would lose its last checkpoint and MLflow records, so the
    end's result (a report of ``kind: end``, or one at ``end``: ``max_steps`` may end a
    trial within its last epoch) is reported once the run is done (``run_trial``). The
    first validation's report that lacks the metric (``Report.monitor_missing``: the trial
    ranks checkpoints by the sweep's metric) ends the trial with an error naming
    ``tune.metric`` and what is reported. A report made after the scheduler stopped the trial raises
    ``SystemExit`` in Tune's ``report``; here that would only end the report thread while
    training went on, so it ends the run instead (``TrialStopped``), and nothing more is
    reported (Tune raises once; another report would wait for it forever)."""

    def __init__(
        self, metric: str, report: Callable[..., object], time_attr: str = "epoch", end: int = 0
    ):
        self.metric = metric
        self.report = report
        self.time_attr, self.end = time_attr, end
        self.latest: dict[str, Any] = {}  # the latest result, reported or not
        self.stopped = False  # by the scheduler: nothing more is reported

    def on_report(self, report: Report) -> None:
        from raytrain.driver.progress import StopRun

        if report.monitor_missing is not None:
            keys = ", ".join(sorted(report.monitor_missing)) or "nothing"
            raise StopRun(
                SpecError(
                    f"tune.metric: {self.metric!r} is not reported by the "
                    f"trials (they report: {keys})"
                )
            )
        value = report.metrics.get(self.metric)
        if not isinstance(value, int | float) or not math.isfinite(value):
            return
        self.latest = tune_result(report.for_ray())
        if self.stopped or report.kind == "end":
            return
        if not self.end or self.latest[self.time_attr] < self.end:
            try:
                self.report(self.latest)
            except SystemExit:
                # Tune raises it once; a later report would wait for Tune without end
                self.stopped = True
                raise StopRun(TrialStopped("the sweep's scheduler stopped this trial")) from None


class TrialStopped(Exception):
    """The sweep's scheduler stopped this trial: its run ends, and the sweep's driver
    closes its MLflow run with the reason (``runner``)."""


def tune_result(event: dict[str, Any]) -> dict[str, Any]:
    """A report's numbers as Tune gets them: ``epoch`` as epochs completed (a report at an
    epoch's end carries that epoch's 0-based number), ``step`` the optimizer steps."""
    metrics = {k: v for k, v in event.items() if _reportable(k, v)}
    return {**metrics, "epoch": epochs_done(event), "step": int(event.get("step", 0))}


def _reportable(key: str, value: object) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and not key.startswith("_")


def run_trial(config: dict[str, Any], plan: TrialPlan) -> None:
    """The Tune trainable: this trial's run (see the module docstring)."""
    from ray import tune

    from raytrain.driver.launcher import run_job
    from raytrain.driver.ray_runtime import adopt_embedded
    from raytrain.sweep.space import trial_spec

    if os.path.isdir(plan.cwd):  # Tune moved this actor into its trial folder
        os.chdir(plan.cwd)
    adopt_embedded(plan.embedded_env)
    name = trial_name(plan.sweep, tune.get_context().get_trial_id())
    spec = trial_spec(plan.base, trial_values(plan, config, name), name)
    end = spec.trainer.max_epochs if plan.time_attr == "epoch" else spec.trainer.max_steps
    reporter = TuneReporter(plan.metric, tune.report, plan.time_attr, max(end or 0, 0))
    # A failed trial's MLflow run is closed by the driver once Tune has ended the trial: a
    # stopped trial's actor may fail while it ends, after the driver closed its run.
    result = run_job(spec, progress=False, listeners=[reporter], close_on_failure=False)
    # A trial already complete (a resumed sweep's) trained nothing now: its last checkpoint's.
    committed = None if reporter.latest else latest_committed(run_dir(spec), spec.storage)
    final = reporter.latest or tune_result(committed[1] if committed else result.metrics)
    if plan.metric not in final:
        raise SpecError(
            f"tune.metric: {plan.metric!r} is not reported by the trials (they "
            f"report: {', '.join(sorted(final)) or 'nothing'})"
        )
    # The last report: where the sweep's driver finds the trial's run and best checkpoint.
    tune.report(
        {
            **final,
            TRIAL_NAME: name,
            BEST_CHECKPOINT: result.best_checkpoint_uri or "",
            MLFLOW_RUN: result.mlflow_run_id or "",
        }
    )
