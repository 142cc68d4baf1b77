"""The driver (`raytrain run`, with its embedded Ray) SIGKILLed mid-run: the same command
run again resumes from the last committed checkpoint and continues the same MLflow run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import pytest

from tests.integration.cli_runs import ROOT, cli_env, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def committed_step(run_dir: Path) -> int | None:
    """The step of the run's latest committed checkpoint, per Ray Train's snapshot."""
    try:
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    latest = snapshot.get("latest_checkpoint_result")
    return int(latest["metrics"]["step"]) if latest else None


def test_killed_driver_resumes_in_the_same_mlflow_run(digits_dir: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    args = [f"data.train.uri={digits_dir / 'train'}", f"data.val.uri={digits_dir / 'val'}",
            "model.class_path=tests.integration.models:SlowCNN", "trainer.max_epochs=4",
            "trainer.log_every_n_steps=5", "data.prepare=null"]  # fmt: skip
    cmd = [sys.executable, "-m", "raytrain", "run", str(ROOT / "jobs" / "digits.yaml"), *args]
    run_dir = tmp_path / "runs" / "digits-cnn"
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(cmd, env=cli_env(), cwd=tmp_path, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        # until the first checkpoint is committed (or the run ends: a failure here)
        while committed_step(run_dir) is None and proc.poll() is None:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        # A second driver of the same run while the first trains: refused before it starts
        # anything, naming the holder; it writes nothing (the third run below is attempt 2).
        state_before = (run_dir / "raytrain-run.json").read_text()
        code, _, out = run_cli(cli_env(), tmp_path, *args)
        assert code == 2, out[-3000:]
        assert f"is in use by another run: pid {proc.pid} on" in out
        assert "--force" in out and "Traceback" not in out
        assert (run_dir / "raytrain-run.json").read_text() == state_before
        assert proc.poll() is None  # the first run goes on
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    killed_at = committed_step(run_dir)
    assert killed_at is not None and killed_at < 4 * 23
    state = json.loads((run_dir / "raytrain-run.json").read_text())

    code, result, out = run_cli(cli_env(), tmp_path, *args)
    assert code == 0, out[-3000:]
    assert f"resuming digits-cnn from {run_dir}" in out
    assert f"taking over the stale lease {run_dir / 'raytrain-lease.json'} of pid {proc.pid}" in out
    assert not (run_dir / "raytrain-lease.json").exists()  # released at the end
    assert result["metrics"]["step"] == 4 * 23
    assert result["mlflow_run_id"] == state["mlflow_run_id"]  # the same MLflow run
    client = MlflowClient(result["tracking_uri"])
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["raytrain.attempts"] == "2"
    logged = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert logged == sorted(set(logged))  # no step twice, none backwards, across drivers
    assert logged[-1] == 4 * 23, out[-3000:]
