"""A worker's own error reaches the user, and the MLflow run is marked FAILED with it."""

from __future__ import annotations

from pathlib import Path

import pytest

import raytrain
from raytrain.records import runstate
from raytrain.spec import parse_spec
from tests.conftest import digits_spec

pytestmark = pytest.mark.integration


def test_worker_exception_is_shown_and_recorded(
    ray_cluster: None, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    """Retries exhausted (the error comes back each time): the worker's own error, exit 1,
    the MLflow run FAILED with the reason. (That no retry is left after the last one, and
    none with ``max_failures: 0``, is ``FailurePolicy``'s, pinned in its unit tests.)"""
    spec = digits_spec(
        digits_dir,
        tmp_path,
        name="exploding",
        model={"class_path": "tests.integration.models:ExplodingCNN", "init_args": {"at_step": 3}},
        failure={"max_failures": 1},
    )
    with pytest.raises(raytrain.TrainingFailed) as excinfo:
        raytrain.fit(spec, progress=False)
    message = str(excinfo.value)
    assert "training failed on rank 1" in message
    assert "ValueError: boom at step 3 on rank 1" in message
    assert excinfo.value.exit_code == 1

    from mlflow.tracking import MlflowClient

    state = runstate.load(parse_spec(spec))
    assert state is not None and state.status == "FAILED"
    client = MlflowClient(tracking_uri=spec["tracking"]["mlflow"]["tracking_uri"])
    run = client.get_run(state.mlflow_run_id)
    assert run.info.status == "FAILED"
    assert "boom at step 3" in run.data.tags["raytrain.error"]


def test_unreachable_tracking_server_stops_the_run(
    ray_cluster: None,
    digits_dir: Path,
    tmp_path: Path,
    clean_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MLflow is opened while the workers start; when it cannot be, training is aborted."""
    import socket

    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    spec = digits_spec(
        digits_dir,
        tmp_path,
        name="untracked",
        trainer={"max_epochs": 200},  # would run for minutes if the abort did not stop it
        tracking={"mlflow": {"tracking_uri": f"http://127.0.0.1:{port}"}},
    )
    with pytest.raises(raytrain.RaytrainError) as excinfo:
        raytrain.fit(spec, progress=False)
    assert excinfo.value.exit_code == 2
    assert str(excinfo.value).startswith("tracking.mlflow.tracking_uri: cannot open")
    assert f"127.0.0.1:{port}" in str(excinfo.value)
    run_dir = Path(runstate.run_dir(parse_spec(spec)))
    assert not list(run_dir.glob("checkpoint_*"))  # stopped before a single epoch ended


def test_nan_loss_on_one_rank_stops_the_run_unretried(
    ray_cluster: None, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    """A NaN on rank 1 alone is caught on every rank at the same step (the all-reduced
    gradients carry it), before that step is applied or checkpointed; with retries left,
    the run is still not retried."""
    import json

    from mlflow.tracking import MlflowClient

    from raytrain.checkpoints.layout import META_FILE, latest_committed

    attempts = tmp_path / "attempts"
    spec = digits_spec(
        digits_dir,
        tmp_path,
        name="nan-loss",
        model={
            "class_path": "tests.integration.models:NaNAtStepCNN",
            "init_args": {"attempts": str(attempts), "at_step": 30},
        },
        trainer={"max_epochs": 3},
        checkpoint={"every_n_steps": 10, "every_n_epochs": None},
        failure={"max_failures": 2},
    )
    with pytest.raises(raytrain.TrainingFailed) as excinfo:
        raytrain.fit(spec, progress=False)
    message = str(excinfo.value)
    assert "NonFiniteLossError" in message
    assert "NaN/Inf at optimizer step 31" in message
    assert attempts.read_text().splitlines() == ["0"]  # trained once: no retry
    run_dir = Path(runstate.run_dir(parse_spec(spec)))
    _, metrics = latest_committed(str(run_dir))
    assert 10 <= metrics["step"] <= 30  # committed before the bad step
    # and no checkpoint was even written after it (committed or not)
    written = [json.loads(meta.read_text())["step"] for meta in run_dir.glob(f"*/{META_FILE}")]
    assert written and max(written) <= 30
    state = runstate.load(parse_spec(spec))
    run = MlflowClient(spec["tracking"]["mlflow"]["tracking_uri"]).get_run(state.mlflow_run_id)
    assert run.info.status == "FAILED"
    # the in-memory state's node copies went with the run (kept every few steps: auto)
    from raytrain.checkpoints.node_slots import keep_scratch_name, slot_paths, state_roots

    scratch = keep_scratch_name(runstate.run_dir(parse_spec(spec)))
    assert not [p for root in state_roots() for p in slot_paths(root, scratch) if Path(p).exists()]
