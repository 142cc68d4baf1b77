"""Jobs sent to a real Ray head, as users send them: ``raytrain submit``, ``ray job submit``
and the Python API, against ``ray start --head`` with token authentication on and a second
node. Each job records its run in MLflow, found by the Ray job id it ran as."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import raytrain
from tests.conftest import digits_spec, write_spec
from tests.integration.cli_runs import ROOT
from tests.integration.ray_head import RAY_CLI, RayHead, ray_head, start_node

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    """A head with 2 CPUs and a worker node with 2: room for 2 workers and Ray Data."""
    work = tmp_path_factory.mktemp("head")
    with ray_head(work, num_cpus=2) as cluster:
        start_node(cluster, work / "node.log", num_cpus=2)
        yield cluster


def job_dir(tmp_path: Path, digits_dir: Path, **sections) -> Path:
    """A working dir to upload: the spec (absolute data, storage and tracking paths: the
    nodes share this machine's disk) and the ``ray job submit`` entrypoint."""
    wd = tmp_path / "wd"
    (wd / "jobs").mkdir(parents=True)
    shutil.copy(ROOT / "jobs" / "train.py", wd / "jobs" / "train.py")
    write_spec(wd / "spec.yaml", digits_spec(digits_dir, tmp_path, **sections))
    return wd


def client_env(head: RayHead, **extra: str) -> dict[str, str]:
    """A client machine's environment: the head's token in RAY_AUTH_TOKEN, no cluster."""
    env = dict(os.environ)
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        env.pop(name, None)
    return {**env, "RAY_AUTH_TOKEN": head.token, **extra}


def raytrain_cli(env: dict[str, str], *args: str, cwd: Path | None = None):
    return subprocess.run(
        [sys.executable, "-m", "raytrain", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )


def run_of_job(tmp_path: Path, job_id: str):
    """The MLflow run the job recorded, by its ``raytrain.ray_job_id`` tag (None: none)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`raytrain.ray_job_id` = '{job_id}'",
    )
    return (client, runs[0]) if runs else (client, None)


def test_raytrain_submit_follows_the_job_to_success_and_records_it(
    head: RayHead, digits_dir: Path, tmp_path: Path
) -> None:
    wd = job_dir(tmp_path, digits_dir, name="submitted")
    for secret in (".env", "id_rsa", ".aws/credentials"):  # never uploaded, named as left out
        (wd / secret).parent.mkdir(exist_ok=True)
        (wd / secret).write_text("SECRET-CONTENT")
    env = client_env(head)
    proc = raytrain_cli(
        env,
        "submit",
        "spec.yaml",
        "trainer.max_epochs=2",
        "--address",
        head.dashboard_url,
        "--follow",
        cwd=wd,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "left out of the upload" in proc.stderr and "SECRET-CONTENT" not in output
    packages = head.temp_dir.glob("session_*/runtime_resources/working_dir_files/_ray_pkg_*")
    unpacked = [pkg for pkg in packages if pkg.is_dir()]
    assert unpacked and all((pkg / "spec.yaml").is_file() for pkg in unpacked), unpacked
    for pkg in unpacked:  # the job's copy of the working dir, as the head unpacked it
        assert not any((pkg / secret).exists() for secret in (".env", "id_rsa", ".aws"))
    job_id = proc.stdout.splitlines()[0]
    assert job_id.startswith("raysubmit_")
    assert f"job {job_id} SUCCEEDED" in proc.stderr
    assert "finished in" in proc.stdout  # the job's own summary, streamed
    client, run = run_of_job(tmp_path, job_id)
    assert run is not None and run.info.status == "FINISHED"
    assert run.data.params["trainer.max_epochs"] == "2"  # the override reached the cluster
    assert len(client.get_metric_history(run.info.run_id, "val_acc")) == 2
    assert run.data.metrics["val_acc"] > 0.5

    status = raytrain_cli(env, "status", job_id, "--address", head.dashboard_url)
    assert status.returncode == 0 and status.stdout.split()[0] == "SUCCEEDED"
    listing = raytrain_cli(env, "list", "--address", head.dashboard_url)
    assert any(job_id in line and "submitted" in line for line in listing.stdout.splitlines())
    logs = raytrain_cli(env, "logs", job_id, "--address", head.dashboard_url)
    assert "finished in" in logs.stdout
    # the token went in a header only: not printed, not in the job's recorded runtime env
    job_record = str(head.request(f"/api/jobs/{job_id}"))
    for text in (output, status.stdout, listing.stdout, logs.stdout, job_record):
        assert head.token not in text


def test_a_submitted_sweep_runs_as_one_job_and_its_status_shows_the_trials(
    head: RayHead, digits_dir: Path, tmp_path: Path
) -> None:
    sweep = {
        "search_space": {"model.init_args.lr": {"grid": [0.003, 0.01]}},
        "metric": "val_acc",
        "mode": "max",
    }
    wd = job_dir(
        tmp_path, digits_dir, name="submitted-sweep", scaling={"num_workers": 1}, tune=sweep
    )
    env = client_env(head)
    proc = raytrain_cli(
        env,
        "submit",
        "spec.yaml",
        "trainer.max_epochs=1",
        "--address",
        head.dashboard_url,
        "--follow",
        cwd=wd,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.splitlines()[0]
    assert "raytrain: sweep submitted-sweep: 1 sample(s)" in proc.stdout + proc.stderr
    status = raytrain_cli(env, "status", job_id, "--address", head.dashboard_url)
    assert status.returncode == 0 and status.stdout.split()[0] == "SUCCEEDED"
    assert "trials ended: 2" in status.stdout
    trials = [
        line.split()[0]
        for line in status.stdout.splitlines()
        if " finished after 1 epoch(s)" in line
    ]
    assert sorted(trials) == ["submitted-sweep-000", "submitted-sweep-001"]
    # MLflow: the job's runs, found by its id: the sweep's parent and a run per trial
    client, _ = run_of_job(tmp_path, job_id)
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`raytrain.ray_job_id` = '{job_id}'",
    )
    (parent,) = [r for r in runs if r.data.tags.get("raytrain.sweep.role") == "parent"]
    assert parent.info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["raytrain.trial"] for r in children) == sorted(trials)


def test_raytrain_status_shows_a_job_training_and_its_last_state_once_its_driver_died(
    head: RayHead, digits_dir: Path, tmp_path: Path
) -> None:
    """The run's status record, read from this process and from `raytrain status JOB_ID`
    in another while the job trains: its step and ETA; the run's series on the node's
    Prometheus endpoint; then the job's driver SIGKILLed:
    the job FAILED, the record's last state, no newer than the kill, with its age."""
    wd = job_dir(
        tmp_path,
        digits_dir,
        name="watched",
        trainer={"max_epochs": 200},
        checkpoint={"every_n_epochs": 1},
    )
    env = client_env(head)
    proc = raytrain_cli(env, "submit", "spec.yaml", "--address", head.dashboard_url, cwd=wd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.splitlines()[0]
    handle = raytrain.attach(job_id, address=head.dashboard_url, token=head.token)
    deadline = time.monotonic() + 300
    # polling the record as a user would: the condition is a file's content
    while (status := handle.progress()) is None or status.eta_s is None or not status.val_metrics:
        assert handle.status() in ("PENDING", "RUNNING"), handle.logs()
        assert time.monotonic() < deadline, handle.logs()
        time.sleep(0.5)
    assert status.state in ("training", "checkpointing") and status.world_size == 2
    assert status.total_steps and 0 < status.step < status.total_steps
    assert status.max_epochs == 200 and "val_acc" in status.val_metrics

    shown = raytrain_cli(env, "status", job_id, "--address", head.dashboard_url)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == "RUNNING"  # the job's state, its message, then the run's record
    heads = ("  watched: training (record ", "  watched: checkpointing (record ")
    assert any(line.startswith(heads) for line in lines), lines
    assert any(
        line.startswith("    progress: step ") and f"/{status.total_steps} (" in line
        for line in lines
    ), lines
    assert any("samples/s, ETA " in line for line in lines), lines
    by_spec = raytrain_cli(env, "status", "spec.yaml", "--json", cwd=wd)  # the same record
    assert by_spec.returncode == 0 and json.loads(by_spec.stdout)["name"] == "watched"

    # Prometheus's view: the nodes' metrics endpoints (the head's service discovery file)
    # serve the run's series beside Ray's own (Ray exports every few seconds: polled as a
    # Prometheus would scrape)
    names = (
        "step",
        "samples_per_second",
        "train_loss",
        "step_part_seconds",
        "restarts",
        "metric",
        "checkpoint_stall_seconds",
    )
    wanted = {f"ray_raytrain_{name}" for name in names}
    while True:
        series = head.scrape(run="watched")
        if wanted <= set(series) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert wanted <= set(series), (sorted(series), head.metrics_diagnosis())
    ranks = {labels["rank"] for labels in series["ray_raytrain_step_part_seconds"]}
    assert ranks == {"0", "1"}
    parts = {(s["part"], s["stat"]) for s in series["ray_raytrain_step_part_seconds"]}
    assert {("busy", "p50"), ("comm_wait", "p90"), ("data_wait", "mean")} <= parts
    assert {s["name"] for s in series["ray_raytrain_metric"]} >= {"val_acc", "val_loss"}
    # every series the Grafana dashboard charts is served (a hang's once there is one)
    dashboard = (ROOT / "cluster" / "grafana" / "raytrain.json").read_text()
    charted = set(re.findall(r"\bray_[a-z_]+\b", dashboard)) - {"ray_raytrain_hangs"}
    assert charted - set(series) - set(head.scrape()) == set()  # Ray's own too

    driver = head.request(f"/api/jobs/{job_id}")["driver_info"]["pid"]
    assert status.driver.endswith(f":{driver}")  # the record names the job's driver
    killed_at = time.time()
    os.kill(int(driver), signal.SIGKILL)
    assert handle.wait(timeout_s=120) == "FAILED"
    last = handle.progress()
    assert last is not None and last.state in ("training", "checkpointing")
    assert status.step <= last.step and last.updated_at <= killed_at  # nothing written since
    after = raytrain_cli(env, "status", job_id, "--address", head.dashboard_url)
    lines = after.stdout.splitlines()
    assert lines[0] == "FAILED" and f"  watched: {last.state} (record " in after.stdout
    assert any(line.startswith(f"    progress: step {last.step}/") for line in lines), lines


def test_ray_job_submit_trains_through_the_entrypoint_and_the_python_api_stops_it(
    head: RayHead, digits_dir: Path, tmp_path: Path
) -> None:
    """``ray job submit`` of ``jobs/train.py``: the job trains and records its run; the
    Python API then finds it by id, stops it and lists it."""
    wd = job_dir(tmp_path, digits_dir, name="ray-job-submit", trainer={"max_epochs": 200})
    env = client_env(head, RAY_AUTH_MODE="token")
    proc = subprocess.run(
        [
            RAY_CLI,
            "job",
            "submit",
            "--address",
            head.dashboard_url,
            "--working-dir",
            ".",
            "--no-wait",
            "--",
            "python",
            "jobs/train.py",
            "spec.yaml",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=wd,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    words = [word.strip("'") for word in proc.stdout.split()]
    job_id = next(word for word in words if word.startswith("raysubmit_"))
    handle = raytrain.attach(job_id, address=head.dashboard_url, token=head.token)
    # training through the entrypoint: its MLflow run has the first epoch's validation
    deadline = time.monotonic() + 300
    while (run := run_of_job(tmp_path, job_id)[1]) is None or "val_acc" not in run.data.metrics:
        assert handle.status() in ("PENDING", "RUNNING"), handle.logs()
        assert time.monotonic() < deadline, handle.logs()
        time.sleep(1)
    assert run.info.status == "RUNNING"
    assert handle.status() == "RUNNING"
    assert handle.stop() is True
    assert handle.wait(timeout_s=120) == "STOPPED"
    again = raytrain.attach(handle.job_id, address=head.dashboard_url, token=head.token)
    assert again.status() == "STOPPED"
    listed = raytrain.list_jobs(address=head.dashboard_url, token=head.token)
    assert handle.job_id in [job.submission_id for job in listed]


def test_a_wrong_or_missing_token_and_an_unknown_job_are_refused_clearly(
    head: RayHead, tmp_path: Path
) -> None:
    wrong = "not-the-token-0123"
    proc = raytrain_cli(
        client_env(head, RAY_AUTH_TOKEN=wrong), "list", "--address", head.dashboard_url
    )
    assert proc.returncode == 2
    assert "refused the token" in proc.stderr and head.dashboard_url in proc.stderr
    assert wrong not in proc.stdout + proc.stderr

    no_token = client_env(head, HOME=str(tmp_path))  # no ~/.ray/auth_token there
    no_token.pop("RAY_AUTH_TOKEN")
    proc = raytrain_cli(no_token, "status", "raysubmit_x", "--address", head.dashboard_url)
    assert proc.returncode == 2 and "requires a token" in proc.stderr

    token_file = tmp_path / "token"
    token_file.write_text(head.token + "\n")
    by_file = {**no_token, "RAY_AUTH_TOKEN_PATH": str(token_file)}
    proc = raytrain_cli(by_file, "status", "raysubmit_nope", "--address", head.dashboard_url)
    assert proc.returncode == 2
    assert "job raysubmit_nope: no such job" in proc.stderr

    with pytest.raises(raytrain.JobsError, match="refused the token"):
        raytrain.attach("raysubmit_nope", address=head.dashboard_url, token=wrong)
