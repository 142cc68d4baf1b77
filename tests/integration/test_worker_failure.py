"""Workers lost mid-run, in one run: a preemption notice (SIGTERM) to a worker, then a rank
that hangs (sleeps without end, outside any collective), then a worker SIGKILLed. The
notice makes the workers checkpoint at the next agreed step and restart from it, uncharged
and without training a step again; the hang is found within ``hang_timeout_s``, every
rank's stacks are saved, and, like the kill, it restarts the workers from the latest
committed checkpoint, or from rank 0's state kept in memory where that is newer (it is
here: every step is kept). The run finishes in the same MLflow run, no metric step is logged
twice or goes back, and it ends as the same run without any of them does (with the same
hang timeout: no hang found where there is none)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import raytrain
from raytrain.checkpoints.layout import META_FILE
from raytrain.records.run_status import read_status
from tests.conftest import digits_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS_PER_EPOCH = 23  # 1,438 rows, 2 workers, 32 a batch
EPOCHS = 8
NOTICE_AT, HANG_AT, KILL_AT = 30, 100, 150  # in epochs 2, 5 and 7
HANG_TIMEOUT = 6.0


def read_events(out_dir: Path) -> list[dict]:
    lines = (out_dir / "events.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda e: e["at"])


def _run(digits_dir: Path, out: Path, name: str, **kills: Any) -> Any:
    out.mkdir()
    spec = digits_spec(
        digits_dir,
        out,
        name=name,
        model={
            "class_path": "tests.integration.models:KillAtStepsCNN",
            "init_args": {
                "out_dir": str(out),
                "run_dir": str(out / "runs" / name),
                "at_steps": [],
                **kills,
            },
        },
        trainer={"max_epochs": EPOCHS, "log_every_n_steps": 5},
        # a monitored key the model never logs: checkpoints are ranked by recency; rank 0's
        # state kept in memory every step
        checkpoint={
            "every_n_epochs": 1,
            "keep": 20,
            "monitor": "val_accuracy",
            "mode": "max",
            "memory_every_n_steps": 1,
        },
        # two failures allowed: the hang and the kill; a preemption charged to them would
        # fail the run
        failure={
            "max_failures": 2,
            "preemption_check_s": 0,  # agree every step
            "hang_timeout_s": HANG_TIMEOUT,
        },
    )
    return raytrain.fit(spec, progress=False)


def test_a_preempted_a_hung_and_a_killed_worker_end_as_an_uninterrupted_run_does(
    ray_cluster: None, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    from mlflow.tracking import MlflowClient

    plain = _run(digits_dir, tmp_path / "plain", "uninterrupted")
    assert not [e for e in read_events(tmp_path / "plain") if e["event"] == "kill"]
    out = tmp_path / "interrupted"
    result = _run(
        digits_dir,
        out,
        "interrupted",
        at_steps=[NOTICE_AT, HANG_AT, KILL_AT],
        signals=["SIGTERM", "HANG", "SIGKILL"],
    )
    last = EPOCHS * STEPS_PER_EPOCH
    assert result.metrics["step"] == plain.metrics["step"] == last
    gap = result.metrics["val_acc"] - plain.metrics["val_acc"]
    assert abs(gap) <= 0.01, (result.metrics["val_acc"], plain.metrics["val_acc"])

    # Checkpoints: one per epoch, at its end, and the notice's; none from the partial epoch
    # the kill lost.
    metas = [json.loads((Path(c) / META_FILE).read_text()) for c in result.checkpoints]
    (noticed,) = [m["step"] for m in metas if m["kind"] == "preemption (SIGTERM)"]
    # Python runs the handler when the worker's main thread next checks for signals, so
    # the notice lands in a step or two after the signal; the checkpoint is of that step.
    assert NOTICE_AT < noticed < 2 * STEPS_PER_EPOCH
    epoch_ends = [STEPS_PER_EPOCH * k for k in range(1, EPOCHS + 1)]
    assert sorted(m["step"] for m in metas) == sorted([*epoch_ends, noticed])
    assert json.loads((Path(result.best_checkpoint_uri) / META_FILE).read_text())["step"] == last

    # The notice's restart began at its checkpoint (no step trained twice; the state in
    # memory is no newer); the hang's and the kill's, at the steps they came in, from the
    # state in memory (storage's last were the epoch ends before them, steps 92 and 138).
    events = read_events(out)
    assert [(e["event"], e["step"]) for e in events if e["event"] != "start"] == [
        ("first_step", 1),
        ("kill", NOTICE_AT),
        ("first_step", noticed + 1),
        ("kill", HANG_AT),
        ("first_step", HANG_AT + 1),
        ("kill", KILL_AT),
        ("first_step", KILL_AT + 1),
    ]

    # The hang: found within its timeout (the watchdog looks once a second), every rank's
    # stacks saved, rank 1 named as the one not in a collective, in its sleep
    (attempt,) = (out / "runs" / "interrupted" / "hangs").iterdir()
    stacks = {p.name: p.read_text() for p in attempt.iterdir() if p.suffix == ".txt"}
    assert set(stacks) == {"rank0.txt", "rank1.txt"}, stacks.keys()
    assert {p.name for p in attempt.glob("*.sent")} == {"rank0.sent", "rank1.sent"}
    hung = stacks["rank1.txt"]
    assert "collective: not in a collective" in hung and "in forward" in hung, hung[:400]
    training = hung.split("\nThread ")[1]  # the first thread shown: the one that trains
    assert "(training), most recent call last" in training, hung
    assert re.search(
        r"models\.py\", line \d+, in training_step\n\s+time\.sleep\(3600\)", training
    ), hung
    assert "collective: in " in stacks["rank0.txt"], stacks["rank0.txt"][:400]
    (hang_event,) = [e for e in events if e["event"] == "kill" and e["step"] == HANG_AT]
    found_at = float(re.search(r"\(unix ([\d.]+)\)", hung).group(1))  # type: ignore[union-attr]
    assert hang_event["at"] < found_at <= hang_event["at"] + HANG_TIMEOUT + 5

    # The run's status record: finished, its last checkpoint, each restart and why
    status = read_status(result.run_dir)
    assert status is not None and status.state == "finished" and status.step == last
    assert status.last_checkpoint is not None and status.last_checkpoint.step == last
    assert status.mlflow_run_id == result.mlflow_run_id and status.world_size == 2
    preempted, hung_restart, killed = status.restarts
    assert preempted.step == noticed and preempted.reason.startswith("PreemptedError")
    assert hung_restart.step == HANG_AT and hung_restart.lost_steps == 0  # memory's
    assert hung_restart.reason.startswith(f"hang at step {HANG_AT}: no batch finished for")
    assert "not in a collective: rank 1 in forward" in hung_restart.reason
    assert "waiting in a collective: rank 0" in hung_restart.reason
    assert status.hang is not None and status.hang in hung_restart.reason
    # the killed rank fails Ray Train's health check; its peer loses gloo's connection
    assert killed.step == KILL_AT and "WorkerHealthCheckFailedError" in killed.reason

    client = MlflowClient(result.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["raytrain.restarts"] == "3"
    assert run.data.tags["raytrain.hang"] == status.hang
    logged = {a.path for a in client.list_artifacts(result.mlflow_run_id, f"hangs/{attempt.name}")}
    assert logged == {f"hangs/{attempt.name}/rank{r}.txt" for r in (0, 1)}
    assert not (tmp_path / "plain" / "runs" / "uninterrupted" / "hangs").exists()
    assert "attempt 1: workers restarted" in run.data.tags["raytrain.restart.1"]
    assert f"resumed at step {noticed}," in run.data.tags["raytrain.restart.1"]
    ranking = run.data.tags["raytrain.checkpoint_ranking"]
    assert "'val_accuracy' was not reported" in ranking
    assert re.search(r"\(reported: [^)]*\bval_acc\b", ranking), ranking
    for key in ("train_loss", "val_acc"):
        logged = [m.step for m in client.get_metric_history(result.mlflow_run_id, key)]
        assert logged == sorted(set(logged)), (key, logged)  # no step twice, none backwards
    train_steps = {m.step for m in client.get_metric_history(result.mlflow_run_id, "train_loss")}
    assert train_steps - {noticed} == set(range(5, last + 1, 5)) | set(epoch_ends)
