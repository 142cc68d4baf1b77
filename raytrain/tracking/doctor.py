"""``raytrain doctor``: where a run's time went, and what to do about it, with the numbers.

It reads the run's records: its status record (``run_status``: wall time, the first
report, restarts) and its MLflow run (every rank's step timeline, ``timeline/rank{r}/
{part}_mean_s``, and the straggler tag). ``step_parts`` turns the timelines into the
run's average step: each part's mean over the run's windows, averaged over the ranks.
``diagnose`` (pure) names what bounds the step, first match wins:

- data-bound: the wait for the next batch is at least ``DATA_SHARE`` of the step;
- communication-bound: the wait in collectives (the gradients' all-reduce, and those the
  step runs itself) is at least ``COMM_SHARE``
  of the step, and no straggler explains it;
- checkpoint-bound: the batch-end hooks (checkpoint saves, reports) are at least
  ``HOOKS_SHARE`` of the step;
- compute-bound: otherwise; the step is forward, backward and the optimizer;

and beside it: a straggler rank, a startup that took at least ``STARTUP_SHARE`` of the
run's wall time, and restarts with the steps they made the run train again.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Any

from raytrain.records.run_status import RunStatus

DATA_SHARE = 0.25
COMM_SHARE = 0.25
HOOKS_SHARE = 0.15
STARTUP_SHARE = 0.3
_TIMELINE = re.compile(r"^timeline/rank(\d+)/(\w+)_mean_s$")


@dataclass(frozen=True)
class Finding:
    kind: str  # data-bound, communication-bound, checkpoint-bound, compute-bound, ...
    text: str  # what was found, with its numbers
    advice: str  # what to do about it


def step_parts(histories: dict[str, list[tuple[int, float]]]) -> dict[str, float]:
    """The run's average step from the ranks' timeline histories: per part, the mean of
    each rank's window means (windows hold the same number of steps), averaged over the
    ranks (seconds): where the time went, bursty waits included. Empty without a
    timeline."""
    per_rank: dict[str, list[float]] = {}
    for key, points in histories.items():
        match = _TIMELINE.match(key)
        if match and points:
            per_rank.setdefault(match.group(2), []).append(
                statistics.fmean(value for _, value in points)
            )
    return {part: statistics.fmean(values) for part, values in per_rank.items()}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def diagnose(
    parts: dict[str, float], status: RunStatus | None, tags: dict[str, str]
) -> list[Finding]:
    """What bounds the run's step, then its straggler, startup and restarts (see the
    module docstring)."""
    findings = [_bound(parts, bool(tags.get("raytrain.straggler")))] if parts.get("step") else []
    if tags.get("raytrain.straggler"):
        findings.append(
            Finding(
                "straggler",
                f"straggler: {tags['raytrain.straggler']}",
                "the others wait for it every step: look at that node (its load, its data, its "
                "device); raytrain restarts it only when it fails",
            )
        )
    if status is not None:
        findings += _startup(status) + _restarts(status)
    return findings


def _bound(parts: dict[str, float], straggler: bool) -> Finding:
    step = parts["step"]
    share = {part: parts.get(part, 0.0) / step for part in parts}
    of = f"of a {_ms(step)} step"
    if share.get("data_wait", 0.0) >= DATA_SHARE:
        return Finding(
            "data-bound",
            f"data-bound: each step waited {_ms(parts['data_wait'])} for its "
            f"batch, {share['data_wait']:.0%} {of}",
            "feed the loader faster: cache the split (data.cache), move data.preprocess "
            "into data.prepare, more reader parallelism, or larger files",
        )
    if share.get("comm_wait", 0.0) >= COMM_SHARE and not straggler:
        return Finding(
            "communication-bound",
            f"communication-bound: each step waited "
            f"{_ms(parts['comm_wait'])} in collectives (the gradients' all-reduce, the "
            f"step's own), "
            f"{share['comm_wait']:.0%} {of}",
            "fewer, larger steps (a larger data.batch_size or "
            "trainer.accumulate_grad_batches), fewer workers, or a faster network",
        )
    if share.get("hooks", 0.0) >= HOOKS_SHARE:
        return Finding(
            "checkpoint-bound",
            f"checkpoint-bound: checkpoints and reports took "
            f"{_ms(parts['hooks'])} a step, {share['hooks']:.0%} {of}",
            "checkpoint less often (checkpoint.every_n_steps / every_n_epochs), "
            "checkpoint.upload: async, or report less often "
            "(trainer.log_every_n_steps)",
        )
    work = sum(parts.get(p, 0.0) for p in ("forward", "backward", "optimizer"))
    return Finding(
        "compute-bound",
        f"compute-bound: forward {_ms(parts.get('forward', 0.0))}, backward "
        f"{_ms(parts.get('backward', 0.0))}, optimizer {_ms(parts.get('optimizer', 0.0))}: "
        f"{work / step:.0%} {of}",
        "the model's own work: mixed precision (trainer.precision: bf16-mixed where the "
        "hardware has it), larger batches on GPUs, or more workers",
    )


def _startup(status: RunStatus) -> list[Finding]:
    if status.first_report_at is None:
        return []
    wall = status.updated_at - status.started_at
    startup = status.first_report_at - status.started_at
    if wall <= 0 or startup / wall < STARTUP_SHARE:
        return []
    return [
        Finding(
            "startup-heavy",
            f"startup-heavy: {startup:.1f} s of the attempt's {wall:.1f} s passed "
            f"before the first report ({startup / wall:.0%})",
            "a run this short pays Ray's and the workers' start: train longer per run, or "
            "start one cluster for several runs (raytrain.start_local)",
        )
    ]


def _restarts(status: RunStatus) -> list[Finding]:
    if not status.restarts:
        return []
    lost = sum(r.lost_steps for r in status.restarts)
    reasons = "; ".join(f"at step {r.step}: {r.reason}" for r in status.restarts[:3])
    return [
        Finding(
            "restarts",
            f"{len(status.restarts)} restart(s) made the run train at least {lost} "
            f"step(s) again ({reasons})",
            "checkpoint more often to lose fewer steps (checkpoint.every_n_steps); fix what "
            "the reasons name",
        )
    ]


def describe(findings: list[Finding], name: str) -> list[str]:
    """The findings as ``raytrain doctor`` prints them."""
    if not findings:
        return [f"{name}: no step timeline or status record to read yet"]
    lines = [f"{name}:"]
    for finding in findings:
        lines += [f"  {finding.text}", f"    -> {finding.advice}"]
    return lines


def run_facts(tracking_uri: str, run_id: str) -> tuple[dict[str, float], dict[str, Any]]:
    """The run's average step (``step_parts``) and its tags, from MLflow."""
    from raytrain.tracking.mlflow_tracker import fetch_runs

    (run,) = fetch_runs(tracking_uri, [run_id])
    return step_parts(run["histories"]), run["tags"]
