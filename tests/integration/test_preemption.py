"""Preemption: a SIGTERM to a worker is a notice, not a crash. The workers save a checkpoint
at the next agreed step, Ray Train commits it, and the run restarts from it without being
charged to ``max_failures`` (here 0) and without training a step again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import raytrain
from raytrain.checkpoints.layout import META_FILE
from tests.conftest import digits_spec
from tests.integration.test_worker_failure import STEPS_PER_EPOCH, read_events

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_sigterm_checkpoints_and_resumes_without_a_failure(
    ray_cluster: None, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    from mlflow.tracking import MlflowClient

    spec = digits_spec(
        digits_dir, tmp_path, name="preempted",
        model={"class_path": "tests.integration.models:KillAtStepsCNN",
               "init_args": {"out_dir": str(tmp_path), "at_steps": [30],
                             "signal_name": "SIGTERM"}},
        trainer={"max_epochs": 3, "log_every_n_steps": 5},
        checkpoint={"every_n_epochs": 1, "keep": 10},
        failure={"max_failures": 0, "preemption_check_s": 0},  # agree every step
    )  # fmt: skip
    result = raytrain.fit(spec, progress=False)
    assert result.metrics["step"] == 3 * STEPS_PER_EPOCH

    metas = [json.loads((Path(c) / META_FILE).read_text()) for c in result.checkpoints]
    by_kind = {m["kind"]: m["step"] for m in metas}
    preempted_at = by_kind["preemption (SIGTERM)"]
    # Python runs the handler when the worker's main thread next checks for signals, so
    # the notice lands in a step or two after the signal; the checkpoint is of that step.
    assert 30 < preempted_at < 2 * STEPS_PER_EPOCH
    assert sorted(m["step"] for m in metas) == sorted([23, preempted_at, 46, 69])

    # The restart began at the preemption checkpoint: no step was trained twice.
    events = read_events(tmp_path)
    assert [(e["event"], e.get("step")) for e in events if e["event"] != "start"] == [
        ("first_step", 1), ("kill", 30), ("first_step", preempted_at + 1)]  # fmt: skip

    client = MlflowClient(result.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    logged = [m.step for m in client.get_metric_history(result.mlflow_run_id, "train_loss")]
    assert logged == sorted(set(logged))
