"""A whole run through ``launcher.run_job``'s seam, without Ray: Ray's handle and the
training phase are fakes, the run folder, the lease, the status record and the MLflow
run (SQLite) are real. How the run ends decides how each record closes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from raytrain.driver.launcher import run_job
from raytrain.driver.results import Trained
from raytrain.records.lease import LEASE_FILE
from raytrain.records.run_status import read_status
from raytrain.records.runstate import load as load_state
from raytrain.records.runstate import run_dir
from raytrain.spec import JobSpec, parse_spec
from tests.conftest import digits_spec


class FakeRay:
    """What ``run_job`` asks of Ray's handle, and how it was left."""

    watch = None

    def __init__(self) -> None:
        self.left: list[bool] = []  # each shutdown's restore_env
        self.restored = 0

    def resources(self) -> dict[str, float]:
        return {"CPU": 2.0}

    def cluster_lost(self) -> bool:
        return False

    def shutdown(self, *, restore_env: bool = True) -> None:
        self.left.append(restore_env)

    def restore_env(self) -> None:
        self.restored += 1


def _run(job: JobSpec, ends: BaseException | None, **options: Any) -> tuple[FakeRay, Any]:
    """``run_job`` with a training phase that opens the MLflow run (as training does) and
    then raises ``ends``, or returns a result with no checkpoint."""
    ray = FakeRay()

    def train(job: JobSpec, handle: Any, record: Any, held: Any, *rest: Any) -> Trained:
        assert handle is ray
        record.start()
        record.tracker()
        if ends is not None:
            raise ends
        result = SimpleNamespace(checkpoint=None, best_checkpoints=[], metrics={}, error=None)
        return Trained(result=result, latest={"step": 3.0, "val_acc": 0.5}, data_paths={})

    out = None
    try:
        out = run_job(
            job,
            progress=False,
            connect=lambda job, verbose: ray,
            train=train,
            **options,
        )
    except BaseException as exc:
        if exc is not ends:
            raise
    return ray, out


def _closed(job: JobSpec) -> tuple[str, str | None, bool]:
    """The MLflow run's status, the status record's state, and whether the lease is left."""
    state = load_state(job)
    assert state is not None
    client = MlflowClient(job.tracking.mlflow.tracking_uri)
    mlflow_status = client.get_run(state.mlflow_run_id).info.status
    status = read_status(run_dir(job), job.storage)
    leased = (Path(run_dir(job)) / LEASE_FILE).exists()
    return mlflow_status, status.state if status else None, leased


@pytest.fixture
def job(tmp_path: Path, digits_dir: Path) -> JobSpec:
    return parse_spec(digits_spec(digits_dir, tmp_path))


def test_a_run_that_trains_closes_every_record_finished_and_leaves_ray_in_the_background(
    job: JobSpec,
) -> None:
    ray, result = _run(job, None)
    assert result is not None and result.metrics["val_acc"] == 0.5
    assert _closed(job) == ("FINISHED", "finished", False)
    assert ray.left == [False] and ray.restored == 1  # stopped in the background


@pytest.mark.parametrize(
    ("ends", "mlflow_status"),
    [(KeyboardInterrupt(), "KILLED"), (RuntimeError("a worker's bug"), "FAILED")],
    ids=["ctrl-c", "error"],
)
def test_a_run_that_fails_closes_each_record_by_how_it_ended(
    job: JobSpec, ends: BaseException, mlflow_status: str
) -> None:
    ray, result = _run(job, ends)
    assert result is None
    assert _closed(job) == (mlflow_status, "failed", False)
    assert ray.left == [True] and ray.restored == 0  # left at once, the environment with it
    status = read_status(run_dir(job), job.storage)
    assert status is not None and status.error == (str(ends) or type(ends).__name__)


def test_a_sweeps_trial_leaves_its_failed_mlflow_run_open_for_the_sweep_to_close(
    job: JobSpec,
) -> None:
    _run(job, RuntimeError("stopped by the scheduler?"), close_on_failure=False)
    assert _closed(job) == ("RUNNING", "failed", False)
