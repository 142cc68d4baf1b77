"""The driver (``raytrain run`` with its embedded Ray) killed mid-run, with its data and
checkpoints on a real S3 API server: the same command run again resumes from the last
checkpoint Ray Train committed, in the same MLflow run, and never from an upload the kill
interrupted.

For real: the first run's S3 traffic goes through a proxy that, once the first checkpoint
is committed, stops answering the upload of the next one (an S3 server that went away
mid-upload). While it hangs there, a second driver of the same run is refused. Then the
whole run (driver and its embedded Ray) is SIGKILLed. The runs are fresh CLI processes, as
a user's would be: the endpoint comes from the spec (``storage.s3.endpoint_url``), then
from the standard ``AWS_ENDPOINT_URL``; credentials only from the environment (the
standard chain), which each embedded Ray's processes inherit, as a cluster's nodes would
have theirs. No output of either run may contain the secret key.

The run also checkpoints every 10 steps with ``checkpoint.monitor: val_acc``: the commit the
kill leaves is a step checkpoint taken before the first validation, which Ray's snapshot
must keep with a finite score (it wrote an infinite one as null, and a rerun then failed at
its first checkpoint, and every rerun after it). The rerun is given the snapshot as an
earlier raytrain left it, null and all, and must repair it and finish.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raytrain.checkpoints.layout import SNAPSHOT_FILE, UNSCORED
from raytrain.contract import SCORE_KEY
from tests.integration.cli_runs import ROOT, checkpoint_dirs, cli_env, digits_on_s3, run_cli
from tests.integration.s3_proxy import s3_proxy
from tests.integration.s3_server import s3_filesystem

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# jobs/digits.yaml's run: its name under the bucket of the digits, and its epochs and keep
RUN = "raytrain-test/runs/digits-cnn"
EPOCHS, KEEP, STEPS_PER_EPOCH = 10, 3, 23
# A secret no output of a run may contain: not the spec, a log, a checkpoint, MLflow.
SECRET = "raytrain-test-secret-4f1d9a"


def read_json(fs: pafs.FileSystem, path: str) -> dict | None:
    try:
        with fs.open_input_stream(path) as stream:
            return json.loads(stream.read())
    except FileNotFoundError:
        return None


def committed_checkpoint(fs: pafs.FileSystem) -> str | None:
    """The folder of the run's latest checkpoint that Ray Train committed, if any."""
    snapshot = read_json(fs, f"{RUN}/checkpoint_manager_snapshot.json")
    latest = snapshot and snapshot["latest_checkpoint_result"]
    return latest["checkpoint_dir_name"] if latest else None


class SecondFileOfSecondFolder:
    """A stall rule for the proxy: a PUT into any checkpoint folder but the first, of a
    file other than the first one PUT there. Ray uploads a folder's files one after the
    other, so the folder is left with one complete file and one that never completes."""

    def __init__(self) -> None:
        self.first: str | None = None
        self.uploads: dict[str, set[str]] = {}  # checkpoint folder -> files PUT into it

    def __call__(self, method: str, path: str) -> bool:
        key = path.split("?")[0].partition(f"/{RUN}/")[2]  # FOLDER/FILE inside the run
        if method != "PUT" or not key.startswith("checkpoint_") or "/" not in key:
            return False
        folder, name = key.split("/", 1)
        if not name:  # the folder's marker object
            return False
        self.first = self.first or folder
        files = self.uploads.setdefault(folder, {name})
        return folder != self.first and name not in files


def test_killed_driver_resumes_from_the_last_committed_checkpoint_on_s3(
    s3_endpoint: str, s3_digits: str, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    fs = s3_filesystem(s3_endpoint)
    env = cli_env(AWS_SECRET_ACCESS_KEY=SECRET)  # the plain server takes any key
    args = [
        *digits_on_s3(s3_digits, "runs"),
        "trainer.log_every_n_steps=5",
        "checkpoint.every_n_steps=10",
    ]
    rule = SecondFileOfSecondFolder()
    with s3_proxy(s3_endpoint) as proxy:
        stalled = proxy.stall_when(rule)
        cmd = [
            sys.executable,
            "-m",
            "raytrain",
            "run",
            str(ROOT / "jobs" / "digits.yaml"),
            "--json",
            "data.prepare=null",
            *args,
            f"storage.s3.endpoint_url={proxy.endpoint}",
        ]
        with open(tmp_path / "first.log", "w") as log:
            proc = subprocess.Popen(
                cmd,
                env=env,
                cwd=tmp_path,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            # Until the upload stalls; a run that ends first (an error) fails the test.
            while not stalled.wait(timeout=1) and proc.poll() is None:
                pass
            assert stalled.is_set(), (tmp_path / "first.log").read_text()[-3000:]
            # and until Ray Train has committed the first checkpoint (its snapshot names it)
            while committed_checkpoint(fs) != rule.first and proc.poll() is None:
                stalled.wait(timeout=0.2)
            # A second driver of the same run while the first holds it: refused before it
            # starts anything, naming the holder; it writes nothing (the resume below is
            # attempt 2).
            state_before = read_json(fs, f"{RUN}/raytrain-run.json")
            code, _, out = run_cli(env, tmp_path, *args, f"storage.s3.endpoint_url={s3_endpoint}")
            assert code == 2, out[-3000:]
            assert f"is in use by another run: pid {proc.pid} on" in out
            assert "--force" in out and "Traceback" not in out
            assert read_json(fs, f"{RUN}/raytrain-run.json") == state_before
            assert proc.poll() is None  # the first run goes on
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and its embedded Ray
            proc.wait(timeout=60)
            proxy.release()

    committed = committed_checkpoint(fs)
    assert committed == rule.first
    folders = {
        i.base_name
        for i in fs.get_file_info(pafs.FileSelector(RUN))
        if i.type == pafs.FileType.Directory
    }
    partial = sorted(folders - {committed})
    assert len(partial) == 1  # the interrupted upload left part of its folder behind
    held = {i.base_name for i in fs.get_file_info(pafs.FileSelector(f"{RUN}/{partial[0]}"))}
    assert len(held) == 1 and held < {"checkpoint.ckpt", "raytrain.json"}
    state = read_json(fs, f"{RUN}/raytrain-run.json")
    assert state is not None
    # The committed step-10 checkpoint came before any val_acc: the worst finite score.
    snapshot = read_json(fs, f"{RUN}/{SNAPSHOT_FILE}")
    assert snapshot is not None
    latest = snapshot["latest_checkpoint_result"]["metrics"]
    assert latest["step"] == 10 and "val_acc" not in latest
    assert latest[SCORE_KEY] == UNSCORED["max"]
    # As raytrain up to df707f1 left it: null (Ray's pydantic wrote its -inf so).
    for result in [*snapshot["checkpoint_results"], snapshot["latest_checkpoint_result"]]:
        result["metrics"][SCORE_KEY] = None
    with fs.open_output_stream(f"{RUN}/{SNAPSHOT_FILE}") as stream:
        stream.write(json.dumps(snapshot).encode())

    # The same command again, the endpoint now from the standard variable.
    env2 = cli_env(AWS_SECRET_ACCESS_KEY=SECRET, AWS_ENDPOINT_URL=s3_endpoint)
    code, result, out = run_cli(env2, tmp_path, *args)
    assert code == 0, out[-3000:]
    uri = f"s3://{RUN}"
    assert result["run_dir"] == uri
    assert f"raytrain: removed {uri}/{partial[0]}: its upload never completed" in out
    assert f"resuming digits-cnn from {uri}/{committed} (" in out
    assert result["resumed_from"] == f"{uri}/{committed}"
    assert fs.get_file_info(f"{RUN}/{partial[0]}").type == pafs.FileType.NotFound
    assert "gave 1 unscored checkpoint(s) in Ray Train's snapshot a finite score" in out
    assert f"taking over the stale lease {uri}/raytrain-lease.json of pid {proc.pid}" in out
    assert fs.get_file_info(f"{RUN}/raytrain-lease.json").type == pafs.FileType.NotFound
    # epochs 2-10 trained once each, on top of the committed first one
    assert result["metrics"]["step"] == EPOCHS * STEPS_PER_EPOCH
    assert result["metrics"]["val_acc"] >= 0.95
    # the driver read the best checkpoint back from S3 and logged the model
    assert result["model_uri"] and "not logged" not in out, out[-3000:]
    ckpt = result["latest_checkpoint_uri"].removeprefix("s3://")
    names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(ckpt))}
    assert {"checkpoint.ckpt", "raytrain.json"} <= names  # the checkpoint is on S3
    assert not (tmp_path / "runs").exists()  # and nothing of it local
    # Retention (checkpoint.keep) deleted the remote copies of the older epochs.
    kept = checkpoint_dirs(fs, uri)
    assert len(kept) == KEEP
    assert sorted(c.rsplit("/", 1)[-1] for c in result["checkpoints"]) == kept

    # The same MLflow run, continued: FINISHED, two attempts, every step logged once.
    assert result["mlflow_run_id"] == state["mlflow_run_id"]
    client = MlflowClient(result["tracking_uri"])
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["raytrain.attempts"] == "2"
    logged = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert logged == sorted(set(logged))  # no step twice, none backwards, across drivers
    assert logged[-1] == EPOCHS * STEPS_PER_EPOCH, out[-3000:]

    # The secret is in no output: the run's objects on S3, MLflow's store, the logs.
    assert SECRET not in (tmp_path / "first.log").read_text() + out
    for info in fs.get_file_info(pafs.FileSelector(RUN, recursive=True)):
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as stream:
                assert SECRET.encode() not in stream.read(), info.path
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
