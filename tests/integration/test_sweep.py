"""Sweeps on Ray Tune, for real: trials that are whole raytrain runs on the session's Ray
cluster, ASHA stopping the poorer ones, MLflow's parent and child runs, the best spec run by
``raytrain run``, and no planted secret in anything the sweep and the runs wrote; a sweep's
metric that no trial reports; and a sweep whose driver (with its embedded Ray) is SIGKILLed
after its first trial finished, continued by the same command."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import raytrain
from tests.conftest import digits_spec
from tests.integration.cli_runs import cli_env
from tests.integration.leaks import files_holding, mlflow_holding
from tests.integration.ray_head import kill_tree

pytestmark = pytest.mark.integration

EPOCHS = 4
STEPS_PER_EPOCH = 45  # the digits' train split, 1 worker, 32 a batch


def _sweep_spec(digits_dir: Path, work: Path, name: str, **tune: Any) -> dict[str, Any]:
    """jobs/digits_sweep.yaml's sweep over the test digits: 4 trials of log-uniform lr, 1
    worker each, 2 at once. Seed 1 draws lr 1.9e-3, 2.3e-2, 2.3e-4, 2.2e-2: the third
    trial starts after both first ones passed the first rung, far behind them."""
    section = {
        "search_space": {"model.init_args.lr": {"loguniform": [1e-4, 3e-2]}},
        "metric": "val_acc",
        "mode": "max",
        "num_samples": 4,
        "seed": 1,
        "max_concurrent_trials": 2,
        "scheduler": {"name": "asha", "grace_period": 1, "reduction_factor": 2, "max_t": EPOCHS},
        **tune,
    }
    return digits_spec(
        digits_dir,
        work,
        name=name,
        scaling={"num_workers": 1},
        trainer={"max_epochs": EPOCHS, "log_every_n_steps": 10, "precision": "32-true", "seed": 42},
        checkpoint={"storage": str(work / "runs"), "every_n_epochs": 1, "keep": 2},
        tune=section,
    )


def _plant(spec: dict[str, Any], digits_dir: Path, work: Path) -> tuple[list[str], str]:
    """Secrets in every field a spec can carry one: a tag (a hub token), a model's argument
    (another), the train set's URI (a presigned URL's signature, in a local folder's name:
    a path with a query), and sampled values (a third token, the signed URI), each a grid of
    one value so that the seeded draws of lr stay the same. Returns the secrets and the
    signed URI. Each made now: a secret written in this file would be found in the copy of
    the tests package a logged model carries."""
    tag, arg, sampled = (f"hf_{secrets.token_hex(16)}" for _ in range(3))
    signature = secrets.token_hex(16)
    signed = work / f"train?X-Amz-Signature={signature}"
    shutil.copytree(digits_dir / "train", signed)
    spec["model"] = {
        "class_path": "tests.integration.models:HubCNN",
        "init_args": {"lr": 0.003, "hub_token": arg},
    }
    spec["data"]["train"]["uri"] = str(signed)
    spec["tracking"]["mlflow"]["tags"] = {"hub": tag}
    spec["tune"]["search_space"] |= {
        "model.init_args.hub_token": {"grid": [sampled]},
        "data.train.uri": {"grid": [str(signed)]},
    }
    return [tag, arg, sampled, signature], str(signed)


def test_a_sweep_stops_poor_trials_records_them_and_its_best_spec_runs(
    ray_cluster: None,
    digits_dir: Path,
    tmp_path: Path,
    clean_env: None,
    capfd: pytest.CaptureFixture[str],
) -> None:
    from dataclasses import asdict

    from mlflow.tracking import MlflowClient

    spec = _sweep_spec(digits_dir, tmp_path, "lr-sweep")
    planted, signed = _plant(spec, digits_dir, tmp_path)
    result = raytrain.tune(spec)
    printed = capfd.readouterr()

    assert len(result.trials) == 4
    stopped = [t for t in result.trials if t.status == "stopped"]
    assert stopped and all(t.epochs < EPOCHS for t in stopped)  # ASHA stopped them early
    assert {t.status for t in result.trials} <= {"finished", "stopped"}
    assert result.best is not None and result.best.status == "finished"
    assert result.best_metrics["val_acc"] >= 0.9
    assert result.best_checkpoint_uri and Path(result.best_checkpoint_uri).is_dir()

    # MLflow: one parent run, a child per trial; a stopped trial's run ends with the reason
    client = MlflowClient(result.tracking_uri)
    parent = client.get_run(result.mlflow_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["raytrain.best_trial"] == result.best.name
    assert parent.data.params["tune.search_space.model.init_args.lr"].startswith("loguniform")
    assert parent.data.params["tune.search_space.data.train.uri"] == (
        f"grid ['{tmp_path}/train?X-Amz-Signature=***']"
    )
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "sweep")} == {
        "sweep/sweep.png",
        "sweep/trials.json",
    }
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    assert sorted(r.data.tags["raytrain.trial"] for r in children) == sorted(
        t.name for t in result.trials
    )
    statuses = {r.data.tags["raytrain.trial"]: r.info.status for r in children}
    assert statuses == dict.fromkeys(statuses, "FINISHED"), (statuses, result.table())
    by_trial = {r.data.tags["raytrain.trial"]: r for r in children}
    for trial in stopped:
        assert by_trial[trial.name].data.tags["raytrain.stopped"].startswith("asha: stopped")
    best_run = by_trial[result.best.name]
    assert best_run.data.tags["raytrain.sampled.model.init_args.lr"] == str(
        result.best.values["model.init_args.lr"]
    )
    assert best_run.data.tags["raytrain.sampled.model.init_args.hub_token"] == "***"
    assert result.best.values["model.init_args.hub_token"] == "***"

    # `raytrain report` of the parent: the trials' curves, a row per trial best first
    from raytrain.tracking.report import build_report

    report = build_report([result.mlflow_run_id], result.tracking_uri)
    assert report.columns[:3] == ["trial", "status", "val_acc"]
    assert [row[0] for row in report.rows] == [row["trial"] for row in result.table()]
    assert {row[1] for row in report.rows if row[0] in {t.name for t in stopped}} == {"stopped"}
    assert len(report.panels["val_acc"]) == 4 and report.png.startswith(b"\x89PNG")

    # The best trial's spec, written out, is a plain spec that `raytrain run` trains, given
    # again what it masks (the first line names those fields)
    assert result.best_spec_path is not None
    text = Path(result.best_spec_path).read_text()
    assert text.splitlines()[0] == (
        "# credentials masked (***): data.train.uri, model.init_args.hub_token, "
        "tracking.mlflow.tags.hub; give them again to run this spec (overrides: FIELD=VALUE)"
    )
    best = yaml.safe_load(text)
    assert (
        "tune" not in best
        and best["model"]["init_args"]["lr"] == result.best.values["model.init_args.lr"]
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "raytrain",
            "run",
            result.best_spec_path,
            "trainer.max_epochs=1",
            f"data.train.uri={signed}",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["name"] == "lr-sweep-best"

    # No planted secret in anything the sweep, its trials and the best run wrote or printed:
    # every file under the sweep's and the run's folders (Tune's included), every MLflow
    # value and artifact, the result, the lines
    assert not files_holding(
        planted, [tmp_path / "runs" / "lr-sweep", tmp_path / "runs" / "lr-sweep-best"]
    )
    assert not mlflow_holding(planted, result.tracking_uri, tmp_path / "artifacts")
    shown = [printed.out, printed.err, proc.stdout, proc.stderr, json.dumps(asdict(result))]
    assert not [s for s in planted for text in shown if s in text]
    tune_dir = tmp_path / "runs" / "lr-sweep" / "tune"
    assert {t.name for t in result.trials} <= {p.name for p in tune_dir.iterdir()}

    # A metric no trial reports stops the sweep at the first validation, naming what is
    with pytest.raises(raytrain.SpecError) as caught:
        raytrain.tune(
            _sweep_spec(
                digits_dir,
                tmp_path,
                "typo-sweep",
                metric="val_accuracy",
                num_samples=1,
                scheduler={"name": "fifo"},
            ),
            progress=False,
        )
    (line,) = caught.value.problems
    assert line.startswith("tune.metric: 'val_accuracy' is not reported by the trials")
    assert "val_acc" in line and "val_loss" in line


def test_a_killed_sweep_continues_without_rerunning_finished_trials(
    digits_dir: Path, tmp_path: Path
) -> None:
    """The sweep's driver, with its embedded Ray, SIGKILLed once a trial finished and
    another is mid-run with a committed checkpoint; the same command again ends with all 4
    trials: the finished one not trained again, the interrupted one resumed from its
    checkpoint."""
    spec = _sweep_spec(digits_dir, tmp_path, "kill-sweep", scheduler={"name": "fifo"})
    spec["model"] = {
        "class_path": "tests.integration.models:StartsCNN",
        "init_args": {"lr": 0.003, "out_dir": str(tmp_path)},
    }
    spec["trainer"]["max_epochs"] = EPOCHS + 1
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    trials_dir = tmp_path / "runs" / "kill-sweep" / "trials"
    cmd = [sys.executable, "-m", "raytrain", "tune", str(path), "--json"]
    proc = subprocess.Popen(
        cmd,
        env=cli_env(),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    finished: list[str] = []
    reader = threading.Thread(target=_finished_trials, args=(proc, finished), daemon=True)
    reader.start()
    caught = None
    try:
        while proc.poll() is None and caught is None:
            caught = _mid_run(trials_dir, finished, EPOCHS - 1) if finished else None
            time.sleep(0.05)  # polling the run folders: the condition is a file's content
    finally:
        kill_tree(proc.pid)  # the driver and its embedded Ray, its trials' workers too
        proc.wait(timeout=60)
    # Read again once nothing runs: the trial caught early in its run may still have
    # committed more (Ray's snapshot trails its uploads), even its last checkpoint.
    interrupted = _mid_run(trials_dir, finished, EPOCHS)
    assert finished and caught and interrupted, "no trial was left mid-run by the kill"
    finished_first = finished[0]
    committed = _committed(trials_dir)  # what each trial had committed when nothing ran
    starts_file = tmp_path / "starts.jsonl"
    started = {json.loads(x)["lr"] for x in starts_file.read_text().splitlines()}

    again = subprocess.run(
        cmd, capture_output=True, text=True, env=cli_env(), cwd=tmp_path, timeout=600
    )
    assert again.returncode == 0, again.stdout + again.stderr
    # the killed driver's lease on the sweep's folder: its pid is gone, so taken over at once
    assert "raytrain: taking over the stale lease " in again.stderr
    assert f"raytrain: sweep kill-sweep: continuing from {tmp_path / 'runs' / 'kill-sweep'}" in (
        again.stderr
    )
    result = json.loads(again.stdout.strip().splitlines()[-1])
    trials = {t["name"]: t for t in result["trials"]}
    assert len(trials) == 4 and {t["status"] for t in trials.values()} == {"finished"}
    assert all(t["epochs"] == EPOCHS + 1 for t in trials.values())

    # Each trial trained from scratch once; the finished one was not started again, and the
    # trial the kill interrupted resumed from its last committed checkpoint, before its end
    starts = [json.loads(x) for x in (tmp_path / "starts.jsonl").read_text().splitlines()]
    lr_of = {name: t["values"]["model.init_args.lr"] for name, t in trials.items()}
    assert [s["lr"] for s in starts].count(lr_of[finished_first]) == 1
    name, seen = interrupted
    first, resumed = [s["step"] for s in starts if s["lr"] == lr_of[name]]
    assert first == 0 and seen == resumed < (EPOCHS + 1) * STEPS_PER_EPOCH
    assert resumed % STEPS_PER_EPOCH == 0  # an epoch's checkpoint
    # Every trial: a trial that had started resumed from what it had committed (from 0
    # again if nothing), one whose run was complete or that had not started, started once
    for name, lr in lr_of.items():
        mine = [s["step"] for s in starts if s["lr"] == lr]
        step, epoch = committed.get(name, (0, -1))
        if lr not in started or epoch >= EPOCHS:
            assert mine == [0], (name, mine, committed)
        else:
            assert mine == [0, step], (name, mine, committed)


def _finished_trials(proc: subprocess.Popen, finished: list[str]) -> None:
    """Collect the names of the trials the sweep's driver says finished (its stderr)."""
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("raytrain: trial ") and " finished after " in line:
            finished.append(line.split()[2])


def _committed(trials_dir: Path) -> dict[str, tuple[int, int]]:
    """Each trial's latest committed checkpoint: (step, epoch), by trial name."""
    out = {}
    for snapshot in trials_dir.glob("*/checkpoint_manager_snapshot.json"):
        latest = json.loads(snapshot.read_text())["latest_checkpoint_result"]
        if latest:
            out[snapshot.parent.name] = (
                int(latest["metrics"]["step"]),
                int(latest["metrics"]["epoch"]),
            )
    return out


def _mid_run(trials_dir: Path, finished: list[str], before: int) -> tuple[str, int] | None:
    """A trial not finished whose latest committed checkpoint is from an epoch before
    ``before``: (name, its step)."""
    for snapshot in trials_dir.glob("*/checkpoint_manager_snapshot.json"):
        name = snapshot.parent.name
        try:
            latest = json.loads(snapshot.read_text())["latest_checkpoint_result"]
        except (ValueError, KeyError):
            continue  # being written
        if name not in finished and latest and latest["metrics"]["epoch"] < before:
            return name, int(latest["metrics"]["step"])
    return None
