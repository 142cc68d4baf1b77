"""``raytrain submit --slurm`` on a real Slurm (``slurm_cluster``: slurmctld, slurmd and
munged on loopback), one run asserting the whole of it:

- the sbatch job starts its own Ray cluster under ``srun`` and trains the digits job;
- Slurm's notice mid-run (``scancel --signal=USR1 --batch``, what ``--signal=B:USR1@GRACE``
  sends before a time limit): the run commits a checkpoint and stops (exit 4), the job
  requeues itself, and its second attempt resumes from exactly that step;
- it ends COMPLETED, val_acc >= 0.95, as attempt 2 of one MLflow run with one value per
  epoch (no step logged twice), nothing of its Ray cluster left running;
- ``raytrain status|logs|stop slurm:JOBID`` read it back (``stop``: it had ended).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from raytrain.cli.app import main
from raytrain.records.run_status import read_status
from raytrain.slurm import control
from tests.conftest import digits_spec, write_spec
from tests.integration.ray_head import _process_table
from tests.integration.slurm_cluster import SlurmCluster, slurm_cluster

ROOT = Path(__file__).resolve().parents[2]
EPOCHS = 20


def _until(what: str, ready: Callable[[], bool], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no output)"
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s; the job said:\n{tail}")
        time.sleep(0.5)


def _cli(cluster: SlurmCluster, work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**cluster.env, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "raytrain", *args],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _in_process(*args: str) -> subprocess.CompletedProcess[str]:
    """A command that reads a job back, run in this process (``SLURM_CONF`` set): its
    exit code and output, as a subprocess's."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _show(cluster: SlurmCluster, number: str) -> control.SlurmJob:
    os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]
    return control.show(number)


def test_a_slurm_job_trains_is_preempted_requeues_and_resumes(
    digits_dir: Path, tmp_path: Path
) -> None:
    work = tmp_path
    spec = digits_spec(digits_dir, work, trainer={"max_epochs": EPOCHS})
    spec["name"] = "digits-slurm"
    write_spec(work / "job.yaml", spec)
    run_dir = str(work / "runs" / "digits-slurm")
    before = os.environ.get("SLURM_CONF")
    with slurm_cluster() as cluster:
        try:
            submitted = _cli(cluster, work, "submit", "job.yaml", "--slurm", "--grace", "60")
            assert submitted.returncode == 0, submitted.stderr
            target = submitted.stdout.strip()
            number = control.job_number(target)
            out = work / ".raytrain" / "slurm" / "digits-slurm" / f"slurm-{number}.out"

            # as soon as the run's own record says it trains: the notice takes a few
            # seconds to land (the record's and the preemption check's intervals), and the
            # run must still be training then
            def training() -> bool:
                assert not _show(cluster, number).ended, out.read_text()
                status = read_status(run_dir)
                return status is not None and status.step >= 5

            _until("the run training", training, 300, out)
            cluster.command("scancel", "--signal=USR1", "--batch", number)

            def requeued() -> bool:
                job = _show(cluster, number)
                assert not job.ended, f"the job ended, not requeued:\n{out.read_text()}"
                return job.restarts == 1 and job.state == "PENDING"

            _until("the job requeued", requeued, 180, out)

            # Slurm holds a requeued job for 2 minutes before it may start again; a
            # cluster admin lifts the hold so, again while Slurm may still be setting it
            def restarted() -> bool:
                if _show(cluster, number).state != "PENDING":
                    return True
                cluster.command("scontrol", "update", f"JobId={number}", "StartTime=now")
                return False

            _until("the requeued job's start", restarted, 120, out)
            _until("the job's end", lambda: _show(cluster, number).ended, 400, out)
            job = _show(cluster, number)
            said = out.read_text(errors="replace")
            status_cli = _in_process("status", target)
            logs_cli = _in_process("logs", target)
            stop_cli = _in_process("stop", target)
        finally:
            if before is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = before
    assert job.state == "COMPLETED" and job.restarts == 1, f"{job.describe()}\n{said}"

    # the first attempt stopped at a committed checkpoint; the second resumed from it
    stopped = re.search(r"stopped on request \(SIGUSR1\).*checkpoint at step (\d+) committed", said)
    resumed = re.search(r"resuming digits-slurm from .*\(epoch \d+, step (\d+)\)", said)
    assert stopped and resumed, said
    assert stopped.group(1) == resumed.group(1)
    order = ["the run exited 4", "requeueing job", "the run exited 0"]
    assert [said.find(line) for line in order] == sorted(said.find(line) for line in order)
    assert -1 not in [said.find(line) for line in order], said

    status = read_status(run_dir)
    assert status is not None and status.state == "finished" and status.attempt == 2
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.metrics["val_acc"] >= 0.95
    history = client.get_metric_history(runs[0].info.run_id, "val_acc")
    assert len(history) == EPOCHS and len({m.step for m in history}) == EPOCHS

    token = work / ".raytrain" / "slurm" / "digits-slurm" / f"ray_token-{number}"
    assert token.stat().st_mode & 0o077 == 0
    assert status_cli.returncode == 0 and "COMPLETED" in status_cli.stdout, status_cli.stderr
    assert "attempt 2" in status_cli.stdout and "finished" in status_cli.stdout
    assert logs_cli.returncode == 0 and "resuming digits-slurm" in logs_cli.stdout
    assert stop_cli.returncode == 0 and "had already ended" in stop_cli.stdout, stop_cli.stderr
    left = [cmd for cmd in (c for _, c in _process_table().values()) if f"rtslurm-{number}" in cmd]
    assert left == []
