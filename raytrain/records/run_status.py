"""A run's live status record, readable from anywhere its storage is: ``raytrain status``.

The driver keeps ``{checkpoint.storage}/{name}/raytrain-status.json`` (``STATUS_FILE``)
while the run lives (``driver.status_record.StatusRecord``): how far along it is (epoch,
step, total, ETA, samples/s), its last validation, its last committed checkpoint, its
world size, the restarts and why, the MLflow run id and its state. Each write is
``storage.write_text``: a reader sees the previous record or the new one, never a part.

The record says when it was written (``updated_at``), so a reader tells a live run from
one whose driver died: the record stops ageing at the driver's last write, and ``age``
says how old it is. Readers get a ``RunStatus``, checked field by field (a record this
version cannot read is a ``RunStateError`` naming the file). Nothing here imports Ray or
Lightning: the CLI and ``JobHandle.progress()`` read it from the user's shell.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from raytrain import storage
from raytrain.errors import RunStateError

if TYPE_CHECKING:
    from raytrain.spec import JobSpec, StorageSpec

STATUS_FILE = "raytrain-status.json"

State = Literal["starting", "training", "checkpointing", "restarting", "finished", "failed"]
# Why a run whose driver ended by itself failed (``RunStatus.failure``): ``bad_input`` (a
# spec, a file, a run folder in use: exit 2), ``non_finite`` (a NaN or inf loss),
# ``workers`` (an exception in the workers: the user's code, or a failure that used up
# ``failure.max_failures``), ``interrupted`` (the driver was asked to stop), ``preempted``
# (it stopped at a committed checkpoint on request: SIGUSR1, a Slurm job's end), ``driver``
# (anything else the driver raised). A driver that died writes none.
FailureKind = Literal[
    "bad_input",
    "non_finite",
    "spike_limit",
    "workers",
    "infrastructure",
    "interrupted",
    "preempted",
    "driver",
]
# States after which the driver writes no more: a record in another state that stopped
# ageing belongs to a driver that died.
FINAL_STATES = ("finished", "failed")


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class CheckpointMark(_Record):
    """The last checkpoint the run committed."""

    step: int = Field(description="the global step it was taken at")
    epoch: int = Field(description="the epoch it was taken in (0-based)")
    at: float = Field(description="when the driver heard it was committed (Unix time)")


class Restart(_Record):
    """A restart of the workers within the run: a failure, a preemption, a resize."""

    at: float = Field(description="when the new workers first reported (Unix time)")
    step: int = Field(
        description="the step they resumed from: the in-memory state's "
        "(checkpoint.memory_every_n_steps) when newer, else the latest committed checkpoint's"
    )
    world_size: int | None = Field(default=None, description="how many workers came back")
    lost_steps: int = Field(
        default=0,
        description="steps trained again: the last reported step before the "
        "failure less the step resumed from (at least; reports come every few steps)",
    )
    reason: str = Field(description="why, as far as the driver knows")


class RunStatus(_Record):
    """One run's status record (see the module docstring)."""

    name: str = Field(description="the run's name")
    state: State = Field(description="what the run is doing")
    started_at: float = Field(description="when this attempt's driver started (Unix time)")
    updated_at: float = Field(description="when the driver wrote this record (Unix time)")
    driver: str = Field(description="the driver's host and pid, host:pid")
    attempt: int = Field(default=1, description="the driver's attempt at the run, from 1")
    epoch: int = Field(default=0, description="the current epoch (0-based)")
    max_epochs: int | None = Field(default=None, description="trainer.max_epochs")
    step: int = Field(default=0, description="optimizer steps done")
    first_report_at: float | None = Field(
        default=None, description="when this attempt's workers first reported (Unix time)"
    )
    total_steps: int | None = Field(
        default=None,
        description="steps the run will take, once known (max_steps, or epochs times the "
        "steps of an epoch)",
    )
    samples_per_s: float | None = Field(default=None, description="the latest throughput")
    eta_s: float | None = Field(
        default=None, description="seconds to the end at the rate since this attempt's first report"
    )
    val_metrics: dict[str, float] = Field(
        default_factory=dict, description="the last validation's metrics"
    )
    last_checkpoint: CheckpointMark | None = Field(default=None, description="committed")
    world_size: int | None = Field(default=None, description="workers training now")
    restarts: list[Restart] = Field(default_factory=list, description="in this attempt")
    mlflow_run_id: str | None = Field(default=None, description="the run's MLflow run")
    straggler: str | None = Field(
        default=None, description="the rank holding the others up now, and by how much"
    )
    hang: str | None = Field(
        default=None, description="the last hang found: where each rank was, its step"
    )
    stopped: str | None = Field(default=None, description="why training stopped early")
    error: str | None = Field(default=None, description="why the run failed")
    failure: FailureKind | None = Field(
        default=None, description="what kind of failure, by the driver's own account"
    )

    @property
    def percent(self) -> float | None:
        """How far along, 0 to 100, once the total is known."""
        if not self.total_steps:
            return None
        return min(100.0, 100.0 * self.step / self.total_steps)

    def age(self, now: float | None = None) -> float:
        """Seconds since the driver wrote the record."""
        return max(0.0, (time.time() if now is None else now) - self.updated_at)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


def status_path(run_dir: str) -> str:
    """Where the record of the run in ``run_dir`` is."""
    return storage.join(run_dir, STATUS_FILE)


def read_status(run_dir: str, options: StorageSpec | None = None) -> RunStatus | None:
    """The record of the run in ``run_dir``; None when there is none (the run has not
    started, or ran before status records existed). A record that cannot be read as one is a
    ``RunStateError`` naming it."""
    path = status_path(run_dir)
    text = storage.read_text(path, options)
    if text is None:
        return None
    try:
        return RunStatus.model_validate(json.loads(text))
    except (ValueError, ValidationError, RecursionError) as exc:
        why = " ".join(str(exc).split())[:200]
        raise RunStateError(f"{path}: the run's status record cannot be read ({why})") from None


def status_of(
    spec: str | os.PathLike[str] | Mapping[str, Any] | JobSpec, overrides: Iterable[str] = ()
) -> RunStatus | None:
    """The record of the run ``spec`` names (a YAML path, a mapping or a ``JobSpec``, with
    dotted ``overrides``): ``raytrain.status``, for a pipeline watching a run it started
    elsewhere. None when there is none yet."""
    from raytrain.checkpoints.layout import run_dir
    from raytrain.spec import load_spec

    job = load_spec(spec, overrides)
    return read_status(run_dir(job), job.storage)


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def describe(status: RunStatus, now: float | None = None) -> list[str]:
    """The record as ``raytrain status`` prints it: a headline, then a line per fact."""
    now = time.time() if now is None else now
    age = status.age(now)
    head = f"{status.name}: {status.state}"
    if status.state not in FINAL_STATES:
        head += f" (record {_duration(age)} old"
        head += "; the driver may have died)" if age > STALE_AFTER_S else ")"
    else:
        head += f" ({_duration(age)} ago)"
    lines = [head]
    where = f"step {status.step}"
    if status.total_steps:
        where += f"/{status.total_steps} ({status.percent:.1f}%)"
    where += f", epoch {status.epoch + 1}/{status.max_epochs or '?'}"
    lines.append(f"  progress: {where}")
    rate = []
    if status.samples_per_s is not None:
        rate.append(f"{status.samples_per_s:.0f} samples/s")
    if status.eta_s is not None and status.state not in FINAL_STATES:
        rate.append(f"ETA {_duration(status.eta_s - min(age, status.eta_s))}")
    if rate:
        lines.append(f"  speed: {', '.join(rate)}")
    if status.val_metrics:
        shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(status.val_metrics.items()))
        lines.append(f"  last validation: {shown}")
    if status.last_checkpoint is not None:
        mark = status.last_checkpoint
        lines.append(
            f"  last checkpoint: step {mark.step} (epoch {mark.epoch + 1}), "
            f"{_duration(now - mark.at)} ago"
        )
    lines.append(
        f"  workers: {status.world_size or '?'}; attempt {status.attempt}; "
        f"restarts: {len(status.restarts)}"
    )
    for restart in status.restarts:
        lines.append(f"    at step {restart.step}: {restart.reason}")
    if status.straggler:
        lines.append(f"  straggler: {status.straggler}")
    if status.hang:
        lines.append(f"  last hang: {status.hang}")
    if status.stopped:
        lines.append(f"  stopped early: {status.stopped}")
    if status.error:
        lines.append(f"  error: {status.error}")
    lines.append(f"  driver: {status.driver}; mlflow run id: {status.mlflow_run_id or '-'}")
    return lines


# A live driver rewrites its record at least this often (``StatusRecord.HEARTBEAT_S``) ...
HEARTBEAT_S = 30.0
# ... so one older than this, not in a final state, has lost its driver.
STALE_AFTER_S = 3 * HEARTBEAT_S
