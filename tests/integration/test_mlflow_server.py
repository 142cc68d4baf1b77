"""What a run records in MLflow, read back through ``MlflowClient`` from a real tracking
server (SQLite backend, artifacts on the S3 test server): params, metrics at their global
steps, system metrics, tags, the spec, the best checkpoint, the logged and registered model;
a server behind basic auth; and ``raytrain report``. A run's restarts and failures, recorded
the same way in any store, are asserted in ``test_worker_failure`` and ``test_failures``.

The module's server is a plain one: behind MLflow's basic-auth app every request pays a
password hash check, which made the run that records everything take 87 s instead of 45."""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

import raytrain
from tests.conftest import digits_spec
from tests.integration.leaks import files_holding, mlflow_holding
from tests.integration.mlflow_server import MlflowServer, mlflow_server
from tests.integration.s3_server import s3_client
from tests.integration.test_worker_failure import STEPS_PER_EPOCH

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "mlflow-artifacts"


@pytest.fixture(scope="module")
def server(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    s3_client(s3_endpoint).create_bucket(Bucket=BUCKET)
    with mlflow_server(tmp_path_factory.mktemp("mlflow"), s3_endpoint, BUCKET) as running:
        yield running


@pytest.fixture
def client(server: MlflowServer, monkeypatch: pytest.MonkeyPatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return MlflowClient(tracking_uri=server.uri)


def _git_head() -> str | None:
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    )
    return proc.stdout.strip() or None


def test_a_run_records_everything_on_the_server(
    ray_cluster: None,
    server: MlflowServer,
    client,
    digits_dir: Path,
    tmp_path: Path,
    s3_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    import mlflow
    import mlflow.pytorch
    import pyarrow.parquet as pq
    import torch

    from raytrain.checkpoints.export import trained_model
    from raytrain.spec import load_spec

    monkeypatch.chdir(ROOT)  # a git checkout: the run records its commit
    # Secrets in every field that can carry one, made now (a secret written in this file
    # would be in the tests package the logged model carries): the tracking URI's user info
    # (the server ignores it: it still works), a tag, a model's argument, the train set's
    # URI (a presigned URL's signature, in a local folder's name: a path with a query)
    password, tag, arg, signature = (secrets.token_hex(16) for _ in range(4))
    planted = [password, f"hf_{tag}", f"hf_{arg}", signature]
    credentialed = server.uri.replace("http://", f"http://raytrain:{password}@")
    signed = tmp_path / f"train?X-Amz-Signature={signature}"
    shutil.copytree(digits_dir / "train", signed)
    # a module without example_input_array: MLflow's input example comes from the data
    spec = digits_spec(
        digits_dir,
        tmp_path,
        name="on-server",
        model={
            "class_path": "tests.integration.models:HubCNN",
            "init_args": {"lr": 0.003, "hub_token": f"hf_{arg}"},
        },
        trainer={"max_epochs": 2, "log_every_n_steps": 5},
        checkpoint={"monitor": "val_acc", "mode": "max"},
        tracking={
            "mlflow": {
                "tracking_uri": credentialed,
                "register_as": "digits-on-server",
                "tags": {"hub": f"hf_{tag}"},
            }
        },
    )
    spec["data"]["train"]["uri"] = str(signed)
    result = raytrain.fit(spec, progress=False)
    printed = capfd.readouterr()
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"

    # params: the whole flattened spec, as run: scaling.use_gpu's auto decided (no GPUs here),
    # each credential masked
    job = load_spec(spec)
    job = job.model_copy(update={"scaling": job.scaling.with_cluster_gpus(0)[0]})
    masked = {
        "tracking.mlflow.tracking_uri": server.uri.replace("http://", "http://***@"),
        "tracking.mlflow.tags.hub": "***",
        "model.init_args.hub_token": "***",
        "data.train.uri": f"{tmp_path}/train?X-Amz-Signature=***",
    }
    expected = {**{k: str(v) for k, v in job.flat().items()}, **masked}
    assert run.data.params == expected

    # per-step and per-epoch metrics at their global steps, each step once
    last = 2 * STEPS_PER_EPOCH
    history = {
        k: [m.step for m in client.get_metric_history(run.info.run_id, k)] for k in run.data.metrics
    }
    assert history["val_acc"] == [STEPS_PER_EPOCH, last]
    assert set(range(5, last + 1, 5)) <= set(history["train_loss"])
    for key, steps in history.items():
        assert steps == sorted(set(steps)) and steps[-1] <= last, key

    # system metrics, from rank 0's training loop
    system = {
        k: [m.value for m in client.get_metric_history(run.info.run_id, k)]
        for k in run.data.metrics
        if k.startswith("system/")
    }
    assert {
        "system/step_time_s",
        "system/data_wait_fraction",
        "system/cpu_percent",
        "system/memory_rss_mb",
    } <= set(system)
    assert all(0 <= v <= 1 for v in system["system/data_wait_fraction"])
    assert all(v > 0 for v in system["system/step_time_s"] + system["system/cpu_percent"])
    assert all(v > 50 for v in system["system/memory_rss_mb"])  # torch alone is more
    assert all(
        v > 0
        for v in (m.value for m in client.get_metric_history(run.info.run_id, "samples_per_s"))
    )

    tags = run.data.tags
    assert tags["raytrain.world_size"] == "2" and tags["raytrain.strategy"] == "ddp"
    assert tags["raytrain.attempts"] == "1" and "raytrain.restarts" not in tags
    assert tags["raytrain.version.ray"].startswith("2.60")
    assert tags["raytrain.version.torch"] == version("torch")
    if _git_head():
        assert tags["mlflow.source.git.commit"] == _git_head()
    assert tags["raytrain.best_checkpoint"] == result.best_checkpoint_uri

    # the resolved spec and the model are artifacts, and they are in the S3 bucket
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "spec.yaml" in artifacts
    spec_text = Path(client.download_artifacts(run.info.run_id, "spec.yaml", str(tmp_path)))
    assert {k: str(v) for k, v in load_spec(spec_text).flat().items()} == expected
    keys = [o["Key"] for o in s3_client(s3_endpoint).list_objects_v2(Bucket=BUCKET)["Contents"]]
    assert any(k.endswith(f"{run.info.run_id}/artifacts/spec.yaml") for k in keys)
    assert any(k.endswith("MLmodel") for k in keys)

    # the registered model loads and predicts as the best checkpoint's weights do
    versions = client.search_model_versions("name='digits-on-server'")
    assert [v.run_id for v in versions] == [run.info.run_id]
    mlflow.set_tracking_uri(server.uri)
    try:
        served = mlflow.pytorch.load_model("models:/digits-on-server/1")
        info = mlflow.models.get_model_info("models:/digits-on-server/1")
    finally:
        mlflow.set_tracking_uri(None)
    assert info.signature is not None and info.signature.inputs.to_dict()[0]["type"] == "tensor"
    assert tags["raytrain.model_format"] == "pt2"
    assert tags["raytrain.model_input_example"] == (
        f"data.val ({digits_dir / 'val'}), column 'pixels'"
    )
    pixels = torch.tensor(
        pq.read_table(digits_dir / "val").column("pixels").to_pylist()[:64], dtype=torch.float32
    )
    trained = trained_model(job, result.best_checkpoint_uri)
    with torch.no_grad():
        assert torch.equal(served(pixels).argmax(1), trained(pixels).argmax(1))
        assert torch.allclose(served(pixels), trained(pixels), atol=1e-6)
    assert result.model_uri and tags["raytrain.model_uri"] == result.model_uri

    # No planted secret in anything the run wrote or printed: every file under its folder,
    # every MLflow value and artifact (the model's too), its result, its lines
    assert not files_holding(planted, [Path(result.run_dir)])
    assert not mlflow_holding(planted, server.uri, tmp_path / "artifacts")
    shown = [printed.out, printed.err, repr(result.__dict__)]
    assert not [s for s in planted for text in shown if s in text]


def test_raytrain_report_draws_and_tabulates_runs(
    server: MlflowServer, client, tmp_path: Path
) -> None:
    from matplotlib.image import imread

    from raytrain.tracking.report import build_report

    experiment = client.create_experiment("report-test")
    run_ids = []
    for lr, slope in (("0.001", 1.0), ("0.01", 2.0)):
        run = client.create_run(experiment, run_name=f"lr-{lr}")
        client.log_param(run.info.run_id, "model.init_args.lr", lr)
        client.log_param(run.info.run_id, "trainer.max_epochs", "2")
        for step in range(1, 11):
            client.log_metric(run.info.run_id, "train_loss", 2.0 / (slope * step), step=step)
            client.log_metric(run.info.run_id, "samples_per_s", 100.0 * slope, step=step)
            client.log_metric(run.info.run_id, "system/step_time_s", 0.1, step=step)
        for step in (5, 10):
            client.log_metric(run.info.run_id, "val_acc", 0.4 * slope * step / 10, step=step)
        client.set_terminated(run.info.run_id)
        run_ids.append(run.info.run_id)

    report = build_report(run_ids, server.uri)
    # the data handed to matplotlib: per panel, one curve per run and key
    drawn = {
        title: sorted((c.key, c.run[:6], len(c.steps)) for c in curves)
        for title, curves in report.panels.items()
    }
    assert drawn == {
        "loss": [("train_loss", "lr-0.0", 10), ("train_loss", "lr-0.0", 10)],
        "metrics": [("val_acc", "lr-0.0", 2), ("val_acc", "lr-0.0", 2)],
        "throughput (samples/s)": [("samples_per_s", "lr-0.0", 10)] * 2,
    }
    rows = {row[0]: row[1:] for row in report.rows}
    assert rows["model.init_args.lr"] == ["0.001", "0.01"]  # the param that differs
    assert "trainer.max_epochs" not in rows  # the same in both
    assert rows["metric: val_acc"] == ["0.4", "0.8"]

    out, page = tmp_path / "report.png", tmp_path / "report.html"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "raytrain",
            "report",
            *run_ids,
            "--tracking-uri",
            server.uri,
            "--out",
            str(out),
            "--html",
            str(page),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(out).shape
    assert width > 2 * height  # three panels side by side
    html = page.read_text()
    assert html.count("<tr>") == len(report.rows) + 1 and "data:image/png;base64," in html
    assert "model.init_args.lr" in proc.stdout

    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "raytrain",
            "report",
            "0" * 32,
            "--tracking-uri",
            server.uri,
            "--out",
            str(tmp_path / "x.png"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert missing.returncode == 2 and f"run {'0' * 32}: not found" in missing.stderr


def test_a_server_behind_basic_auth_works_through_mlflows_variables(
    ray_cluster: None,
    s3_endpoint: str,
    digits_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    from mlflow.tracking import MlflowClient

    from raytrain.driver.run_record import RunRecord
    from raytrain.spec import parse_spec

    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    s3_client(s3_endpoint).create_bucket(Bucket="mlflow-auth-artifacts")
    with mlflow_server(tmp_path, s3_endpoint, "mlflow-auth-artifacts", auth=True) as secured:
        spec = digits_spec(
            digits_dir,
            tmp_path,
            name="behind-auth",
            trainer={"max_epochs": 1},
            tracking={"mlflow": {"tracking_uri": secured.uri, "log_model": False}},
        )

        # No credentials, then a wrong password: refused, naming the server, not the
        # password. Opened as fit opens the run's records while its workers start (that fit
        # then stops its run and raises this is test_failures' unreachable-server test).
        def refused() -> raytrain.TrackingError:
            record = RunRecord(parse_spec(spec), None)
            record.start()
            with pytest.raises(raytrain.TrackingError, match=secured.uri) as excinfo:
                record.tracker()
            return excinfo.value

        refused()
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", secured.username)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password-42")
        assert "not-the-password-42" not in str(refused())

        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", secured.password)
        result = raytrain.fit(spec, progress=False)
        run = MlflowClient(tracking_uri=secured.uri).get_run(result.mlflow_run_id)
        assert run.info.status == "FINISHED" and run.data.metrics["val_acc"] > 0.3
        printed = capfd.readouterr()
        recorded = [
            *run.data.params.values(),
            *run.data.tags.values(),
            printed.out,
            printed.err,
            str(result.__dict__),
        ]
        assert not [text for text in recorded if secured.password in text]
