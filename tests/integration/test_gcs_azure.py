"""``gs://`` and ``abfs://`` end to end: the digits job reads its data from, and keeps its
checkpoints in, a local GCS API server (gcp-storage-emulator) and a local Azure Blob server
(Azurite), then resumes from there; endpoints and credentials from each provider's standard
variables. The runs are ``raytrain.fit`` calls on the session's cluster, as a pipeline's
would be: the driver builds the filesystem from its own environment and Ray ships it to
the workers, so the variables need to be set in the driver only. (S3 differs: each worker
resolves its own credentials, so the S3 runs are fresh CLI processes, their embedded Ray
started with the variables.) The missing-bucket refusal is the CLI's: exit 2."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import raytrain
from tests.conftest import digits_spec
from tests.integration.cli_runs import checkpoint_dirs, cli_env, digits_on_s3, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory: pytest.TempPathFactory, digits_dir: Path) -> Iterator[tuple]:
    """(the emulator's endpoint, a filesystem on it) with the digits in ``gs://raytrain-test``."""
    from tests.integration.gcs_server import create_bucket, gcs_server

    with gcs_server(tmp_path_factory.mktemp("gcs") / "gcs.log") as endpoint:
        create_bucket(endpoint, "raytrain-test")
        fs = pafs.GcsFileSystem(
            anonymous=True, scheme="http", endpoint_override=endpoint.removeprefix("http://")
        )
        pafs.copy_files(str(digits_dir), "raytrain-test/digits", pafs.LocalFileSystem(), fs)
        yield endpoint, fs


@pytest.fixture(scope="module")
def azure(tmp_path_factory: pytest.TempPathFactory, digits_dir: Path) -> Iterator[tuple]:
    """(Azurite's connection details, a filesystem on it) with the digits in container
    ``raytrain-test``."""
    from tests.integration.azure_server import azurite

    work = tmp_path_factory.mktemp("azurite")
    with azurite(work / "azurite.log", work) as cfg:
        fs = pafs.AzureFileSystem(
            account_name=cfg["account_name"],
            account_key=cfg["account_key"],
            blob_storage_authority=cfg["authority"],
            blob_storage_scheme="http",
            dfs_storage_authority=cfg["authority"],
            dfs_storage_scheme="http",
        )
        fs.create_dir("raytrain-test")
        pafs.copy_files(str(digits_dir), "raytrain-test/digits", pafs.LocalFileSystem(), fs)
        yield cfg, fs


def trains_and_resumes(
    digits_dir: Path, work: Path, fs: pafs.FileSystem, root: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """Train 2 epochs with data and checkpoints under ``root``, then resume for a third."""
    spec = digits_spec(
        digits_dir,
        work,
        name="digits-cnn",
        data={"train": {"uri": f"{root}/digits/train"}, "val": {"uri": f"{root}/digits/val"}},
        checkpoint={"storage": f"{root}/runs", "keep": 1},
    )
    first = raytrain.fit(spec, progress=False)
    assert first.run_dir == f"{root}/runs/digits-cnn"
    assert first.metrics["val_acc"] > 0.5  # learned from the data it read there
    [kept] = checkpoint_dirs(fs, first.run_dir.split("://", 1)[1])  # retention: keep 1
    assert first.latest_checkpoint_uri == f"{first.run_dir}/{kept}"
    assert not (work / "runs").exists()

    capfd.readouterr()
    spec["trainer"] = {**spec["trainer"], "max_epochs": 3}
    second = raytrain.fit(spec, progress=False)
    assert f"resuming digits-cnn from {first.latest_checkpoint_uri}" in capfd.readouterr().err
    assert second.metrics["step"] == first.metrics["step"] + 23
    assert second.mlflow_run_id == first.mlflow_run_id


def test_gcs_data_and_checkpoints(
    gcs: tuple,
    ray_cluster: None,
    digits_dir: Path,
    tmp_path: Path,
    clean_env: None,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    endpoint, fs = gcs
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
    trains_and_resumes(digits_dir, tmp_path, fs, "gs://raytrain-test", capfd)


def test_azure_data_and_checkpoints(
    azure: tuple,
    ray_cluster: None,
    digits_dir: Path,
    tmp_path: Path,
    clean_env: None,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    cfg, fs = azure
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", cfg["connection_string"])
    trains_and_resumes(digits_dir, tmp_path, fs, "abfs://raytrain-test", capfd)
    # The account key (pickled into the filesystem Ray ships to its workers) is in no file
    # the runs wrote: not in the run's folder on the store, not in MLflow's store here.
    key = cfg["account_key"].encode()
    for info in fs.get_file_info(pafs.FileSelector("raytrain-test/runs", recursive=True)):
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as stream:
                assert key not in stream.read(), info.path
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or key not in path.read_bytes(), path


def test_missing_bucket_stops_the_run(gcs: tuple, azure: tuple, tmp_path: Path) -> None:
    """Preflight on gs:// and abfs:// as on s3://: exit 2, the URI and the cause."""
    cases = [
        (cli_env(STORAGE_EMULATOR_HOST=gcs[0]), "gs"),
        (cli_env(AZURE_STORAGE_CONNECTION_STRING=azure[0]["connection_string"]), "abfs"),
    ]
    for env, scheme in cases:
        code, _, out = run_cli(
            env,
            tmp_path,
            *digits_on_s3(f"{scheme}://raytrain-test", "runs"),
            f"checkpoint.storage={scheme}://no-such-bucket/runs",
            timeout=30,
        )
        assert code == 2, out[-3000:]
        missing = f"{scheme}://no-such-bucket/runs: the bucket 'no-such-bucket' does not exist"
        assert f"checkpoint.storage: {missing}" in out
