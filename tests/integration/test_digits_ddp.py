"""The main path end to end on a real local Ray: 2-worker DDP, checkpoints, MLflow, resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import raytrain
from raytrain.checkpoints.layout import CKPT_FILE
from raytrain.cli.app import main
from raytrain.records.run_status import read_status
from tests.conftest import digits_spec, write_spec
from tests.integration.ray_head import processes_below

pytestmark = pytest.mark.integration
EPOCHS = 4


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("digits-ddp")


# The SIGINT handlers of this process before and after the first run.
SIGINT_AROUND_FIRST_RUN: dict[str, Any] = {}


@pytest.fixture(scope="module")
def first_run(ray_cluster: None, digits_dir: Path, work: Path) -> tuple[dict[str, Any], Any]:
    os.environ.pop("RAY_ADDRESS", None)
    spec = digits_spec(
        digits_dir,
        work,
        # rank 1 a straggler: it sleeps 3x its step time in each step after its first 10;
        # every step then runs collectives of its own, where rank 0 waits for rank 1
        model={
            "class_path": "tests.integration.models:SlowRankCNN",
            "init_args": {"lr": 0.003, "slow_rank": 1, "times": 3.0, "collective": True},
        },
        trainer={"max_epochs": EPOCHS, "log_every_n_steps": 5, "seed": 7},
        checkpoint={"storage": str(work / "runs"), "keep": 2, "monitor": "val_acc", "mode": "max"},
    )
    SIGINT_AROUND_FIRST_RUN["before"] = signal.getsignal(signal.SIGINT)
    result = raytrain.fit(spec, progress=False)
    SIGINT_AROUND_FIRST_RUN["after"] = signal.getsignal(signal.SIGINT)
    return spec, result


def _client(spec: dict[str, Any]):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=spec["tracking"]["mlflow"]["tracking_uri"])


def test_two_worker_ddp_learns_digits(first_run) -> None:
    _, result = first_run
    assert result.metrics["world_size"] == 2
    assert result.metrics["val_acc"] >= 0.9
    assert result.metrics["epoch"] == EPOCHS - 1


def powersgd_numbers(model: torch.nn.Module, rank: int = 1, rate: float = 2.0) -> int:
    """The numbers PowerSGD sends for ``model``'s gradients a step: a tensor of 2 or more
    dimensions, seen as (rows, the rest), as its two rank-``rank`` factors where that
    compresses ``rate`` times (torch's ``_should_compress``), every other tensor whole."""
    numbers = 0
    for param in model.parameters():
        rows, cols = param.shape[0], param[0].numel()
        small = param.dim() > 1 and (rows + cols) * rank * rate < rows * cols
        numbers += (rows + cols) * rank if small else param.numel()
    return numbers


def test_powersgd_learns_digits_as_the_plain_all_reduce_and_slurm_leaves_ranks_alone(
    first_run, digits_dir: Path, work: Path
) -> None:
    """The digits job's 10 epochs, plain all-reduce and PowerSGD rank 1, same seed. At 4
    epochs PowerSGD trailed by 0.033 here, at 8 by 0.022, at 10 by 0.017: its low-rank
    gradients (under Adam) need more steps to reach the same accuracy.

    The plain run's workers also look like Slurm tasks (``SlurmTaskCNN``): a Ray worker
    started under ``srun`` inherits ``SLURM_*``, and Lightning's own detection would then
    take rank 5 of 8 from Slurm; raytrain's workers take Ray Train's
    (``RayLightningEnvironment``)."""
    from raytrain.models.digits import DigitsCNN

    out = work / "slurm-task"
    out.mkdir()

    def run(hook: str, model: dict[str, Any]) -> Any:
        spec = digits_spec(
            digits_dir,
            work,
            name=f"digits-{hook}",
            model=model,
            strategy={"name": "ddp", "ddp": {"comm_hook": hook}},
            trainer={"max_epochs": 10, "log_every_n_steps": 5, "seed": 7},
        )
        return raytrain.fit(spec, progress=False)

    slurm_task = {
        "class_path": "tests.integration.models:SlurmTaskCNN",
        "init_args": {"out_dir": str(out), "lr": 0.003},
    }
    plain = run("none", slurm_task)
    compressed = run("powersgd", {"class_path": "raytrain.models.digits:DigitsCNN"})
    assert compressed.metrics["val_acc"] == pytest.approx(plain.metrics["val_acc"], abs=0.02)
    model = DigitsCNN()
    whole = 4 * sum(p.numel() for p in model.parameters())
    sent = compressed.metrics["comm_bytes_per_step"]
    assert sent == 4 * powersgd_numbers(model)  # counted in the hook, on gloo
    assert whole / sent > 30  # 38282 numbers sent as 973: 39 times fewer bytes
    assert "comm_bytes_per_step" not in plain.metrics  # no hook but the timeline's

    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["rank"] for s in seen] == [0, 1] and plain.metrics["world_size"] == 2
    assert all(s["world_size"] == 2 for s in seen)
    assert all(s["environment"] == "RayLightningEnvironment" for s in seen)
    assert all(s["slurm_detected"] for s in seen)  # the variables were there to be taken


def _ray_processes(*names: str) -> list[str]:
    """The processes of this test's local Ray that run one of the named actors (``ray::NAME``):
    another Ray on the machine (a second suite, a soak) runs actors of the same names."""
    actors = {f"ray::{name}" for name in names}
    return [
        f"{pid} {cmd}"
        for pid, cmd in processes_below(os.getpid()).items()
        if cmd.split()[:1] and cmd.split()[0] in actors
    ]


def test_a_finished_run_leaves_no_actor_and_the_callers_sigint_handler(first_run) -> None:
    """``fit`` returned: the run's controller and metrics sink end with it (each one's
    process does, a moment after its actor is killed), and a Ctrl-C in the caller's
    program is the caller's again, not Ray Train's abort of a run that is over."""
    assert SIGINT_AROUND_FIRST_RUN["after"] is SIGINT_AROUND_FIRST_RUN["before"]
    deadline = time.monotonic() + 30
    while (
        left := _ray_processes("TrainController", "MetricsSink")
    ) and time.monotonic() < deadline:
        time.sleep(0.2)  # polls for the processes' exit (ray.kill does not wait for it)
    assert not left


def test_the_ranks_timelines_name_the_slow_rank_in_status_and_mlflow(
    first_run, work: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 sleeps 3x its early step time in each step: both ranks' steps take as long
    (DDP), but rank 0 spends the difference waiting at the all-reduce its training step
    runs, so rank 1's own busy time is rank 0's plus the sleep (4x when it is named): it is
    named in the status record, in MLflow and by `raytrain doctor`, and every rank's
    timeline windows are in MLflow."""
    spec, result = first_run
    status = read_status(result.run_dir)
    assert status is not None and status.state == "finished"
    assert status.straggler is not None and status.straggler.startswith("rank 1 on ")
    client = _client(spec)
    run = client.get_run(result.mlflow_run_id)
    local = client.download_artifacts(run.info.run_id, "timeline.json")
    windows = json.loads(Path(local).read_text())["windows"]
    busy = {w["step"]: [w["ranks"][r]["parts"]["busy"][0] for r in ("0", "1")] for w in windows}
    # Count, don't trust: rank 1's extra busy time is the sleep it added (3x its median wall
    # step over its first 10, as the model logged it), in every late window, so rank 0's wait
    # at the step's own collectives is not taken for its own work. The factor is therefore
    # 1 + sleep / rank 0's busy time in that window: 4.0x when named (the early steps' busy
    # time near their wall time), about 7x later, as rank 0's steps got faster.
    slept = max(m.value for m in client.get_metric_history(run.info.run_id, "straggler_sleep_s"))
    late = sorted(busy)[-5:]
    for step in late:
        fast, slow = busy[step]
        assert abs((slow - fast) - slept) <= 0.25 * slept, (step, fast, slow, slept)
    for said, step in ((status.straggler, late[-1]), (run.data.tags["raytrain.straggler"], None)):
        named = re.match(r"rank 1 on \S+: ([\d.]+)x the other .* \(since step (\d+)\)", said)
        assert named is not None, said
        fast, slow = busy[step if step is not None else int(named.group(2))]
        assert float(named.group(1)) == pytest.approx(slow / fast, abs=0.051), (said, busy)
        assert float(named.group(1)) >= 3.0, said
    for rank in (0, 1):
        history = client.get_metric_history(run.info.run_id, f"timeline/rank{rank}/busy_p50_s")
        assert len(history) >= 10  # a window every 5 steps
    late_ranks = [w["ranks"] for w in windows[-5:]]
    assert all(set(ranks) == {"0", "1"} for ranks in late_ranks)
    for ranks in late_ranks:  # the one who waits is rank 0, for rank 1's extra forward time
        fast, slow = ranks["0"]["parts"], ranks["1"]["parts"]
        assert fast["comm_wait"][0] > slow["comm_wait"][0]
        assert slow["forward"][0] > 2 * fast["forward"][0]

    # `raytrain doctor`: the straggler, not the network, explains rank 0's wait
    spec_path = write_spec(work / "doctor.yaml", spec)
    assert main(["doctor", str(spec_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "digits-test:" and lines[1].startswith("  compute-bound: forward "), lines
    assert any(line.startswith("  straggler: rank 1 on ") for line in lines), lines


def test_checkpoint_holds_full_lightning_state(first_run) -> None:
    _, result = first_run
    assert result.best_checkpoint_uri is not None
    path = Path(result.best_checkpoint_uri) / CKPT_FILE
    state = torch.load(path, map_location="cpu", weights_only=False)
    assert {"state_dict", "optimizer_states", "loops", "epoch", "global_step"} <= set(state)
    assert state["global_step"] > 0
    # keep=2: Ray deleted the rest, and the folder holds exactly the kept checkpoints
    kept = sorted(p.name for p in Path(result.run_dir).glob("checkpoint_*") if p.is_dir())
    assert kept == sorted(Path(uri).name for uri in result.checkpoints)
    assert len(kept) == 2


def test_mlflow_run_has_params_tags_spec_and_metric_history(first_run) -> None:
    spec, result = first_run
    client = _client(spec)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.max_epochs"] == str(EPOCHS)
    assert run.data.params["model.class_path"] == "tests.integration.models:SlowRankCNN"
    assert run.data.tags["raytrain.world_size"] == "2"
    assert run.data.tags["raytrain.strategy"] == "ddp"
    assert run.data.tags["raytrain.version.ray"].startswith("2.")
    assert run.data.tags["raytrain.best_checkpoint"] == result.best_checkpoint_uri
    loss_steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert len(loss_steps) >= 5
    assert loss_steps == sorted(set(loss_steps))  # at their global step, none twice
    val = client.get_metric_history(run.info.run_id, "val_acc")
    assert len(val) == EPOCHS
    assert val[-1].value == pytest.approx(result.metrics["val_acc"])
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "spec.yaml" in artifacts


def test_changed_spec_under_same_name_is_refused(first_run) -> None:
    spec, _ = first_run
    changed = {**spec, "model": {**spec["model"], "init_args": {"lr": 0.5}}}
    with pytest.raises(raytrain.RunStateError, match=r"model\.init_args\.lr"):
        raytrain.fit(changed, progress=False)


_NO_RAY_DRIVER = r"""
import json, sys
from raytrain.cli.app import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "ray": "ray" in sys.modules}))
"""


def test_rerun_of_the_finished_run_says_complete_before_ray(first_run, work: Path) -> None:
    """The same command again, nothing left to train: said in about a second, from the
    real checkpoint's metrics, with no Ray, no attempt and nothing logged (the resume
    test below sees one attempt more, not two)."""
    spec, result = first_run
    path = write_spec(work / "job.yaml", spec)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    proc = subprocess.run(
        [sys.executable, "-c", _NO_RAY_DRIVER, "run", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcome == {"rc": 0, "ray": False}, proc.stderr
    assert (
        f"run digits-test is complete: its latest checkpoint {result.latest_checkpoint_uri} "
        f"is at epoch {EPOCHS}, step {result.metrics['step']}"
    ) in proc.stderr
    assert "raise trainer.max_epochs or trainer.max_steps" in proc.stderr
    assert "resuming" not in proc.stderr
    run = _client(spec).get_run(result.mlflow_run_id)
    assert run.data.tags["raytrain.attempts"] == "1"


def test_same_command_resumes_from_last_step(first_run, work: Path) -> None:
    """Run through the CLI, as a user would: a new process with its own embedded Ray."""
    spec, result = first_run
    last_step = result.metrics["step"]
    path = write_spec(work / "job.yaml", spec)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "raytrain",
            "run",
            str(path),
            f"trainer.max_epochs={EPOCHS + 1}",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming digits-test from {result.latest_checkpoint_uri}" in proc.stderr
    assert f"step {last_step})" in proc.stderr
    resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert resumed["mlflow_run_id"] == result.mlflow_run_id
    assert resumed["metrics"]["epoch"] == EPOCHS  # one more epoch, not a restart
    steps_per_epoch = last_step // EPOCHS
    assert resumed["metrics"]["step"] == last_step + steps_per_epoch

    client = _client(spec)
    steps = [m.step for m in client.get_metric_history(result.mlflow_run_id, "train_loss")]
    assert steps == sorted(set(steps))
    new_steps = [s for s in steps if s > last_step]
    assert new_steps and min(new_steps) > last_step
    epochs = client.get_metric_history(result.mlflow_run_id, "val_acc")
    assert len(epochs) == EPOCHS + 1
    tags = client.get_run(result.mlflow_run_id).data.tags
    assert tags["raytrain.attempts"] == "2"
    assert f"from {result.latest_checkpoint_uri}" in tags["raytrain.attempt.2"]
