"""A worker SIGKILLed mid-epoch: the workers restart from the latest committed checkpoint,
the run finishes in the same MLflow run, and no metric step is logged twice or goes back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import raytrain
from raytrain.checkpoint import META_FILE
from tests.conftest import digits_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS_PER_EPOCH = 23  # 1,438 rows, 2 workers, 32 a batch


def test_killed_worker_restarts_from_the_last_checkpoint(
    ray_cluster: None, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    from mlflow.tracking import MlflowClient

    marker = tmp_path / "killed"
    spec = digits_spec(
        digits_dir, tmp_path, name="worker-killed",
        model={"class_path": "tests.integration.models:KillOnceCNN",
               "init_args": {"marker": str(marker), "at_step": 30}},
        trainer={"max_epochs": 3, "log_every_n_steps": 5},
        checkpoint={"every_n_epochs": 1, "keep": 5},
        failure={"max_failures": 1},
    )  # fmt: skip
    result = raytrain.fit(spec, progress=False)
    assert marker.read_text() == "30"  # rank 1 was killed at step 30, in epoch 2
    assert result.metrics["step"] == 3 * STEPS_PER_EPOCH  # epoch 2 re-ran from step 23
    assert result.metrics["val_acc"] > 0.5

    # Checkpoints: one per epoch, at its end; none from the lost attempt's partial epoch.
    steps = [json.loads((Path(c) / META_FILE).read_text())["step"] for c in result.checkpoints]
    assert sorted(steps) == [23, 46, 69]
    client = MlflowClient(result.tracking_uri)
    for key in ("train_loss", "val_acc"):
        logged = [m.step for m in client.get_metric_history(result.mlflow_run_id, key)]
        assert logged == sorted(set(logged)), (key, logged)  # no step twice, none backwards
    train_steps = [m.step for m in client.get_metric_history(result.mlflow_run_id, "train_loss")]
    expected = set(range(5, 3 * STEPS_PER_EPOCH + 1, 5)) | {23, 46, 69}
    assert set(train_steps) == expected
