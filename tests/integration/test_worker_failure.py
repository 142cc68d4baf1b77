"""A worker SIGKILLed mid-epoch: the workers restart from the latest committed checkpoint,
the run finishes in the same MLflow run, and no metric step is logged twice or goes back."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import raytrain
from raytrain.checkpoints.layout import META_FILE
from tests.conftest import digits_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS_PER_EPOCH = 23  # 1,438 rows, 2 workers, 32 a batch


def read_events(out_dir: Path) -> list[dict]:
    lines = (out_dir / "events.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda e: e["at"])


def test_killed_worker_restarts_from_the_last_checkpoint(
    ray_cluster: None, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    from mlflow.tracking import MlflowClient

    spec = digits_spec(
        digits_dir, tmp_path, name="worker-killed",
        model={"class_path": "tests.integration.models:KillAtStepsCNN",
               "init_args": {"out_dir": str(tmp_path), "at_steps": [30],
                             "run_dir": str(tmp_path / "runs" / "worker-killed")}},
        trainer={"max_epochs": 3, "log_every_n_steps": 5},
        # a monitored key the model never logs: checkpoints are ranked by recency
        checkpoint={"every_n_epochs": 1, "keep": 5, "monitor": "val_accuracy", "mode": "max"},
        failure={"max_failures": 1},
    )  # fmt: skip
    result = raytrain.fit(spec, progress=False)
    events = read_events(tmp_path)
    # rank 1 was killed at step 30, in epoch 2; training restarted from epoch 1's checkpoint
    # (step 23): the first step it finished then was step 24
    assert [(e["event"], e["step"]) for e in events if e["event"] != "start"] == [
        ("first_step", 1), ("kill", 30), ("first_step", 24)]  # fmt: skip
    assert result.metrics["step"] == 3 * STEPS_PER_EPOCH  # epoch 2 re-ran from step 23
    assert result.metrics["val_acc"] > 0.5

    # Checkpoints: one per epoch, at its end; none from the lost attempt's partial epoch.
    steps = [json.loads((Path(c) / META_FILE).read_text())["step"] for c in result.checkpoints]
    assert sorted(steps) == [23, 46, 69]
    assert json.loads((Path(result.best_checkpoint_uri) / META_FILE).read_text())["step"] == 69
    client = MlflowClient(result.tracking_uri)
    ranking = client.get_run(result.mlflow_run_id).data.tags["raytrain.checkpoint_ranking"]
    assert "'val_accuracy' was not reported" in ranking
    assert re.search(r"\(reported: [^)]*\bval_acc\b", ranking), ranking
    for key in ("train_loss", "val_acc"):
        logged = [m.step for m in client.get_metric_history(result.mlflow_run_id, key)]
        assert logged == sorted(set(logged)), (key, logged)  # no step twice, none backwards
    train_steps = [m.step for m in client.get_metric_history(result.mlflow_run_id, "train_loss")]
    expected = set(range(5, 3 * STEPS_PER_EPOCH + 1, 5)) | {23, 46, 69}
    assert set(train_steps) == expected


def test_two_kills_end_as_an_uninterrupted_run_does(
    ray_cluster: None, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    """The same seed with and without 2 injected worker kills: val_acc within 1 point."""
    results = {}
    for name, at_steps in (("uninterrupted", []), ("killed-twice", [60, 150])):
        out = tmp_path / name
        out.mkdir()
        spec = digits_spec(
            digits_dir, out, name=name,
            model={"class_path": "tests.integration.models:KillAtStepsCNN",
                   "init_args": {"out_dir": str(out), "at_steps": at_steps,
                                 "run_dir": str(out / "runs" / name)}},
            trainer={"max_epochs": 10}, checkpoint={"every_n_epochs": 1},
            failure={"max_failures": 2},
        )  # fmt: skip
        results[name] = raytrain.fit(spec, progress=False)
        kills = [e["step"] for e in read_events(out) if e["event"] == "kill"]
        assert kills == at_steps
    assert results["killed-twice"].metrics["step"] == results["uninterrupted"].metrics["step"]
    gap = results["killed-twice"].metrics["val_acc"] - results["uninterrupted"].metrics["val_acc"]
    assert abs(gap) <= 0.01, {k: r.metrics["val_acc"] for k, r in results.items()}
