"""A Lightning project brought as it is: Lightning's own demo classes; a LightningCLI config
(a module that unpacks ``x, y = batch``, a DataModule, EarlyStopping, LearningRateMonitor,
LightningCLI's optimizer and scheduler) run by ``raytrain run`` and resumed; and a
map-style DataModule killed mid-epoch and resumed on fewer workers, every row trained
once per epoch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
import yaml

import raytrain
from raytrain.checkpoints.layout import CKPT_FILE, META_FILE
from raytrain.util.precision import decide
from tests.integration.cli_runs import cli_env

pytestmark = pytest.mark.integration


def _tracking(tmp_path: Path) -> dict[str, Any]:
    return {"mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "log_model": False}}


def _run(client: Any, result: Any) -> Any:
    return client.get_run(result.mlflow_run_id)


def test_lightnings_demo_classes_run_unchanged(
    ray_cluster: None, tmp_path: Path, clean_env: None
) -> None:
    from mlflow.tracking import MlflowClient

    demos = "lightning.pytorch.demos.boring_classes"
    spec = {
        "name": "boring",
        "model": {"class_path": f"{demos}.BoringModel"},
        "data": {"class_path": f"{demos}.BoringDataModule"},
        "trainer": {"max_epochs": 2, "profiler": "pytorch"},
        "checkpoint": {"storage": str(tmp_path / "runs")},
        "tracking": _tracking(tmp_path),
    }
    result = raytrain.fit(spec, progress=False)
    run = _run(MlflowClient(result.tracking_uri), result)
    assert run.info.status == "FINISHED"
    # trainer.precision: auto, decided by the workers' CPU (this machine's)
    assert run.data.tags["raytrain.precision"] == "{} ({})".format(*decide("auto", False))
    assert run.data.params["model.class_path"] == f"{demos}:BoringModel"
    # 64 samples a batch of one each, on 2 workers: 32 steps an epoch
    assert result.metrics["step"] == 2 * 32 and result.metrics["world_size"] == 2

    # ckpt_path: a new run starts from that Lightning checkpoint, its step count and all
    started = {
        **spec,
        "name": "boring-from",
        "trainer": {"max_epochs": 3},
        "ckpt_path": str(Path(result.latest_checkpoint_uri) / CKPT_FILE),
    }
    assert raytrain.fit(started, progress=False).metrics["step"] == 3 * 32

    # trainer.profiler: pytorch left rank 0's trace in the run's storage and in MLflow: JSON
    # that chrome://tracing and Perfetto open, holding the training steps
    profiles = tmp_path / "runs" / "boring" / "profiles"
    (trace,) = profiles.glob("fit-rank0-*training_step*.pt.trace.json")  # one per hook
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("training_step" in str(event.get("name")) for event in events)
    assert (profiles / "fit-rank0-0.txt").exists()  # the summary table
    logged = MlflowClient(result.tracking_uri).list_artifacts(result.mlflow_run_id, "profiles")
    assert {p.name for p in profiles.iterdir()} == {Path(a.path).name for a in logged}


def _cli_config(tmp_path: Path) -> dict[str, Any]:
    """A LightningCLI config as its users write it; raytrain's sections beside it."""
    return {
        "seed_everything": 42,
        "trainer": {
            "accelerator": "auto",
            "devices": "auto",
            "max_epochs": 20,
            "log_every_n_steps": 10,
            "enable_checkpointing": None,
            "precision": "32-true",
            "callbacks": [
                {
                    "class_path": "lightning.pytorch.callbacks.EarlyStopping",
                    "init_args": {
                        "monitor": "val_acc",
                        "mode": "max",
                        "stopping_threshold": 0.9,
                        "patience": 50,
                    },
                },
                {"class_path": "LearningRateMonitor", "init_args": {"logging_interval": "epoch"}},
            ],
            "logger": [
                {"class_path": "CSVLogger", "init_args": {"save_dir": "logs"}},
                {"class_path": "TensorBoardLogger", "init_args": {"save_dir": "tb"}},
            ],
        },
        "model": {
            "class_path": "tests.integration.models.RankEndsClassifier",
            "init_args": {"out_dir": str(tmp_path)},
        },
        "data": {
            "class_path": "raytrain.datasets.digits_module.DigitsDataModule",
            "init_args": {"batch_size": 32},
        },
        "optimizer": {"class_path": "torch.optim.Adam", "init_args": {"lr": 0.003}},
        "lr_scheduler": {
            "class_path": "torch.optim.lr_scheduler.StepLR",
            "init_args": {"step_size": 1, "gamma": 0.5},
        },
        "ckpt_path": None,
        "checkpoint": {"storage": "runs"},  # relative: to the directory raytrain runs in
        "tracking": _tracking(tmp_path),
    }


def _ends(tmp_path: Path) -> list[dict[str, int]]:
    lines = (tmp_path / "ends.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_a_lightning_cli_config_runs_with_raytrain_run_and_resumes(
    ray_cluster: None, tmp_path: Path, clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    config = tmp_path / "digits-cli.yaml"
    config.write_text(yaml.safe_dump(_cli_config(tmp_path)))
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain", "run", str(config), "--json"],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "has no name: the run is named 'digits-cli'" in proc.stderr
    assert first["name"] == "digits-cli"

    # EarlyStopping stopped the run once val_acc reached 0.9, every rank at the same step
    steps_per_epoch = 23  # 1,438 rows, 2 workers, 32 a batch
    assert first["metrics"]["val_acc"] >= 0.9
    stop = first["metrics"]["step"]
    assert stop < 20 * steps_per_epoch and stop % steps_per_epoch == 0
    assert sorted(e["rank"] for e in _ends(tmp_path)) == [0, 1]
    assert {e["step"] for e in _ends(tmp_path)} == {stop}
    assert "EarlyStopping" in first["stopped"] and "0.9" in first["stopped"]
    assert "stopped early at step" in proc.stderr

    client = MlflowClient(first["tracking_uri"])
    run = client.get_run(first["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert "EarlyStopping" in run.data.tags["raytrain.stopped"]
    # LearningRateMonitor's values (with each report of its epoch), halved each epoch by StepLR
    history = client.get_metric_history(first["mlflow_run_id"], "lr-Adam")
    by_epoch = {
        m.step // steps_per_epoch - (m.step % steps_per_epoch == 0): m.value for m in history
    }
    assert by_epoch == pytest.approx({k: 0.003 * 0.5**k for k in range(stop // steps_per_epoch)})

    # The user's CSVLogger and TensorBoardLogger wrote on rank 0, under the run's folder
    (csv,) = (tmp_path / "runs" / "digits-cli" / "logs").rglob("metrics.csv")
    assert "val_acc" in csv.read_text().splitlines()[0]
    assert list((tmp_path / "runs" / "digits-cli" / "tb").rglob("events.out.tfevents.*"))

    # Every checkpoint holds the user's callbacks' state, which Lightning restores on resume.
    # Lightning runs EarlyStopping's epoch-end check after every other callback's hook, so
    # the epoch's checkpoint holds its state from the validation before.
    last = torch.load(Path(first["latest_checkpoint_uri"]) / CKPT_FILE, weights_only=False)
    (stopper,) = [v for k, v in last["callbacks"].items() if k.startswith("EarlyStopping")]
    assert 0.5 < float(stopper["best_score"]) <= first["metrics"]["val_acc"]

    # The same config again resumes: the step count continues from the stop, and the
    # restored EarlyStopping stops it after the next validation, in the same MLflow run
    (tmp_path / "ends.jsonl").unlink()
    monkeypatch.chdir(tmp_path)  # (the session's Ray cluster was started elsewhere)
    again = raytrain.fit(config, progress=False)
    assert again.mlflow_run_id == first["mlflow_run_id"]
    assert again.metrics["step"] == stop + steps_per_epoch
    assert {e["step"] for e in _ends(tmp_path)} == {stop + steps_per_epoch}
    assert again.stopped is not None
    # its loggers wrote beside the first attempt's, though its workers run elsewhere
    assert len(list((tmp_path / "runs" / "digits-cli" / "tb").rglob("events.out.*"))) == 2


def _rows_spec(tmp_path: Path, digits_dir: Path, workers: int, **model: Any) -> dict[str, Any]:
    ids = pq.read_table(digits_dir / "train", columns=["id"]).column("id").to_pylist()
    return {
        "name": "datamodule-rows",
        "model": {
            "class_path": "tests.integration.models:SeenCountCNN",
            "init_args": {
                "out_dir": str(tmp_path),
                "num_ids": max(ids) + 1,
                "run_dir": str(tmp_path / "runs" / "datamodule-rows"),
                **model,
            },
        },
        "data": {
            "class_path": "tests.integration.models.DigitsRowsModule",
            "init_args": {
                "train": str(digits_dir / "train"),
                "val": str(digits_dir / "val"),
                "out_dir": str(tmp_path),
            },
        },
        "scaling": {"num_workers": workers},
        "trainer": {"max_epochs": 2, "log_every_n_steps": 5, "precision": "32-true"},
        "checkpoint": {"storage": str(tmp_path / "runs"), "every_n_steps": 10, "keep": 20},
        "tracking": _tracking(tmp_path),
    }


def test_a_map_style_datamodule_resumes_mid_epoch_on_fewer_workers_exactly(
    ray_cluster: None, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    """2 workers, rank 1 SIGKILLed at step 45 (epoch 1 runs steps 31-60 at 24 a batch),
    the run failing there; the same run again on 1 worker: from the step-40 checkpoint, 10
    steps into epoch 1, it trains the rest of that epoch and epoch 2, and the final model
    has trained every row exactly once per epoch."""
    ids = pq.read_table(digits_dir / "train", columns=["id"]).column("id").to_pylist()
    spec = _rows_spec(tmp_path, digits_dir, 2, at_steps=[45])
    with pytest.raises(raytrain.TrainingFailed):
        raytrain.fit(spec, progress=False)
    setups = [json.loads(x) for x in (tmp_path / "setup.jsonl").read_text().splitlines()]
    assert sorted(s["rank"] for s in setups) == [0, 1]  # setup on every rank

    # (rank 1, which the kill was for, is not in a 1-worker run)
    result = raytrain.fit(_rows_spec(tmp_path, digits_dir, 1, at_steps=[45]), progress=False)

    def step(checkpoint: str) -> int:
        return json.loads((Path(checkpoint) / META_FILE).read_text())["step"]

    assert result.resumed_from is not None and step(result.resumed_from) == 40
    assert result.metrics["world_size"] == 1

    final = max(result.checkpoints, key=step)
    seen = torch.load(Path(final) / CKPT_FILE, map_location="cpu", weights_only=False)
    counts = seen["state_dict"]["seen"]
    assert counts[ids].tolist() == [2] * len(ids) and int(counts.sum()) == 2 * len(ids)


def test_an_iterable_datamodule_resumes_at_the_epoch_boundary_exactly(
    ray_cluster: None, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    """An iterable train set (each rank iterating its own part) keeps no position, so the
    checkpoints due every 10 steps are taken at epoch ends: 2 workers, rank 1 SIGKILLed at
    step 45, the run resumes on 1 worker from the step-30 checkpoint (epoch 0's end), not
    from step 40, and the final model has trained every row exactly once per epoch."""
    ids = pq.read_table(digits_dir / "train", columns=["id"]).column("id").to_pylist()

    def spec(workers: int) -> dict[str, Any]:
        out = _rows_spec(tmp_path, digits_dir, workers, at_steps=[45])
        out["data"]["init_args"]["iterable"] = True
        return out

    with pytest.raises(raytrain.TrainingFailed):
        raytrain.fit(spec(2), progress=False)
    result = raytrain.fit(spec(1), progress=False)

    def step(checkpoint: str) -> int:
        return json.loads((Path(checkpoint) / META_FILE).read_text())["step"]

    assert result.resumed_from is not None and step(result.resumed_from) == 30
    assert sorted(step(c) for c in result.checkpoints) == [30, 90]  # epoch ends only
    final = max(result.checkpoints, key=step)
    seen = torch.load(Path(final) / CKPT_FILE, map_location="cpu", weights_only=False)
    counts = seen["state_dict"]["seen"]
    assert counts[ids].tolist() == [2] * len(ids) and int(counts.sum()) == 2 * len(ids)


EXAMPLES = "tests.integration.lightning_examples"


def _backbone_config(tmp_path: Path, data: str, callbacks: list[Any]) -> dict[str, Any]:
    """Lightning's backbone example as LightningCLI writes its config: ``LitClassifier``
    given a nested ``Backbone`` class_path, whose activation is a class_path too."""
    return {
        "seed_everything": 7,
        "model": {
            "class_path": f"{EXAMPLES}.LitClassifier",
            "init_args": {
                "learning_rate": 0.001,
                "backbone": {
                    "class_path": f"{EXAMPLES}.Backbone",
                    "init_args": {"hidden_dim": 32, "activation": {"class_path": "torch.nn.Tanh"}},
                },
            },
        },
        "data": {
            "class_path": data,
            "init_args": {
                "data_dir": str(tmp_path / "mnist"),
                "val_split": 128,
                "num_workers": 0,
                "batch_size": 32,
            },
        },
        "trainer": {
            "max_epochs": 4,
            "log_every_n_steps": 2,
            "precision": "32-true",
            "callbacks": callbacks,
        },
        "checkpoint": {"storage": "runs"},
        "tracking": _tracking(tmp_path),
    }


def _run_backbone(tmp_path: Path, config: dict[str, Any], *args: str) -> tuple[dict, str]:
    """``raytrain validate`` then ``raytrain run`` of ``config`` in a fresh process, over
    MNIST-shaped files written here: (the run's JSON result, its stderr)."""
    from tests.integration.lightning_examples import write_mnist

    write_mnist(tmp_path / "mnist")
    path = tmp_path / "backbone.yaml"
    path.write_text(yaml.safe_dump(config))
    env = cli_env(PL_USE_MOCKED_MNIST="1")
    check = subprocess.run(
        [sys.executable, "-m", "raytrain", "validate", str(path), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert check.returncode == 0, check.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain", "run", str(path), "--json", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["metrics"]["step"] == 4 * 8  # 512 rows, 2 workers, 32 a batch
    return result, proc.stderr


def _learned(result: dict[str, Any]) -> list[float]:
    """Asserts train_loss fell by more than half and valid_loss was logged every epoch;
    returns the epochs' valid_loss_epoch."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(result["tracking_uri"])
    train = [m.value for m in client.get_metric_history(result["mlflow_run_id"], "train_loss_step")]
    assert len(train) >= 8 and sum(train[-3:]) < 0.5 * sum(train[:3]), train
    valid = client.get_metric_history(result["mlflow_run_id"], "valid_loss_epoch")
    assert len(valid) == 4 and all(v.value > 0 for v in valid)
    return [v.value for v in valid]


def test_lightnings_backbone_example_runs_from_its_cli_config_with_its_model_checkpoint(
    tmp_path: Path, clean_env: None
) -> None:
    """Lightning's backbone_image_classifier example on Lightning's own MNISTDataModule,
    over MNIST-shaped files written here (PL_USE_MOCKED_MNIST: no download), its
    ModelCheckpoint(monitor=valid_loss_epoch, mode=min) read as raytrain's checkpoint
    settings: the nested classes are built on the workers (else DDP refuses a model with no
    parameters), train_loss falls, valid_loss is logged, and the checkpoints kept are the
    best by valid_loss_epoch."""
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"monitor": "valid_loss_epoch", "mode": "min", "save_top_k": 2},
    }
    mnist = "lightning.pytorch.demos.mnist_datamodule.MNISTDataModule"
    result, stderr = _run_backbone(tmp_path, _backbone_config(tmp_path, mnist, [checkpoint]))
    assert stderr.count("ModelCheckpoint becomes raytrain's checkpoint settings") == 1
    valid = _learned(result)

    # ranked by valid_loss_epoch, min: the best is the lowest, and the kept ones the 2 best
    def loss(checkpoint: str) -> float:
        meta = json.loads((Path(checkpoint) / META_FILE).read_text())
        return float(meta["valid_loss_epoch"])

    assert loss(result["best_checkpoint_uri"]) == pytest.approx(min(valid))
    kept = sorted(loss(c) for c in result["checkpoints"])
    assert kept[:2] == pytest.approx(sorted(valid)[:2])


def test_the_backbone_example_without_model_checkpoint_under_a_cli_class_that_links(
    tmp_path: Path, clean_env: None
) -> None:
    """The same config without its ModelCheckpoint, run with ``--cli`` naming a project's
    LightningCLI subclass whose ``link_arguments`` gives the DataModule's ``num_classes``
    (12 here) to the backbone nested in the model, once the DataModule is built: the head
    trained has 12 outputs (10 without the link), train_loss falls, valid_loss is logged,
    raytrain's own checkpoint defaults apply (the latest kept, ranked by step), and the
    model MLflow logs is built as the workers built theirs."""
    config = _backbone_config(tmp_path, f"{EXAMPLES}.MNISTClasses", [])
    config["data"]["init_args"]["classes"] = 12
    config["tracking"]["mlflow"]["log_model"] = True
    result, stderr = _run_backbone(tmp_path, config, "--cli", f"{EXAMPLES}:BackboneCLI")
    assert "ModelCheckpoint" not in stderr
    _learned(result)
    # MLflow's model is built as the workers built it: the nested backbone, the linked head
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(result["tracking_uri"]).get_run(result["mlflow_run_id"]).data.tags
    assert "raytrain.model_error" not in tags, tags["raytrain.model_error"]
    assert tags["raytrain.model_uri"]
    state = torch.load(
        Path(result["latest_checkpoint_uri"]) / CKPT_FILE, map_location="cpu", weights_only=False
    )["state_dict"]
    assert state["backbone.l2.weight"].shape == (12, 32)
    assert result["best_checkpoint_uri"] == result["latest_checkpoint_uri"]
