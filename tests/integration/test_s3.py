"""The digits job with its data and checkpoints on a real S3 API server, then resumed there.

The runs are fresh CLI processes, as a user's would be: the endpoint comes from the spec
(``storage.s3.endpoint_url``) or the standard ``AWS_ENDPOINT_URL``, credentials only from
the environment (the standard chain), and each embedded Ray's processes inherit them, as a
cluster's nodes would have theirs.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tests.integration.cli_runs import checkpoint_dirs, cli_env, digits_on_s3, run_cli
from tests.integration.conftest import S3_DIGITS_FILES
from tests.integration.s3_server import s3_filesystem

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# A secret no output of a run may contain: not the spec, a log, a checkpoint, MLflow.
SECRET = "raytrain-test-secret-4f1d9a"


def test_digits_on_s3_trains_resumes_and_keeps_no_secret(
    s3_endpoint: str, s3_digits: str, tmp_path: Path
) -> None:
    fs = s3_filesystem(s3_endpoint)
    assert len(fs.get_file_info(pafs.FileSelector("raytrain-test/digits/train"))) == S3_DIGITS_FILES
    env = cli_env(AWS_SECRET_ACCESS_KEY=SECRET)  # the plain server takes any key
    args = [*digits_on_s3(s3_digits, "runs"), f"storage.s3.endpoint_url={s3_endpoint}"]

    code, first, out1 = run_cli(env, tmp_path, *args)
    assert code == 0, out1[-3000:]
    assert first["metrics"]["val_acc"] >= 0.95
    assert first["run_dir"] == f"{s3_digits}/runs/digits-cnn"
    # the driver read the best checkpoint back from S3 and logged the model
    assert first["model_uri"] and "not logged" not in out1, out1[-3000:]
    ckpt = first["latest_checkpoint_uri"].removeprefix("s3://")
    names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(ckpt))}
    assert {"checkpoint.ckpt", "raytrain.json"} <= names  # the checkpoint is on S3
    assert not (tmp_path / "runs").exists()  # and nothing of it local
    # Retention (checkpoint.keep: 3) deleted the remote copies of the 7 older epochs.
    kept = checkpoint_dirs(fs, first["run_dir"])
    assert len(kept) == 3
    assert [c.rsplit("/", 1)[-1] for c in first["checkpoints"]] != [] and all(
        c.rsplit("/", 1)[-1] in kept for c in first["checkpoints"]
    )

    # The same run name resumes from S3: the endpoint now from the standard variable.
    env2 = cli_env(AWS_SECRET_ACCESS_KEY=SECRET, AWS_ENDPOINT_URL=s3_endpoint)
    code, second, out2 = run_cli(env2, tmp_path, *digits_on_s3(s3_digits, "runs"),
                                 "trainer.max_epochs=11")  # fmt: skip
    assert code == 0, out2[-3000:]
    assert f"resuming digits-cnn from {first['latest_checkpoint_uri']}" in out2
    assert second["metrics"]["step"] == first["metrics"]["step"] + 23  # one more epoch
    assert second["mlflow_run_id"] == first["mlflow_run_id"]

    # The secret is in no output: the run's objects on S3, MLflow's store, the logs.
    assert SECRET not in out1 + out2
    for info in fs.get_file_info(pafs.FileSelector("raytrain-test/runs", recursive=True)):
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as stream:
                assert SECRET.encode() not in stream.read(), info.path
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_many_file_prefix_streams_with_projection(
    s3_endpoint: str, s3_digits: str, tmp_path: Path
) -> None:
    """``data.cache: never``: Ray Data streams the 24-file prefix, each worker its shard."""
    fs = s3_filesystem(s3_endpoint)
    code, result, out = run_cli(
        cli_env(), tmp_path, *digits_on_s3(s3_digits, "streamed"), "data.cache=never",
        f"storage.s3.endpoint_url={s3_endpoint}", "trainer.max_epochs=3",
    )  # fmt: skip
    assert code == 0, out[-3000:]
    assert result["data_paths"] == {"train": "streamed", "val": "streamed"}
    assert result["metrics"]["val_acc"] >= 0.8
    # An equal streaming split of 1438 rows over 2 workers, 32 a batch: 23 steps an epoch.
    assert result["metrics"]["step"] == 3 * 23
    assert len(checkpoint_dirs(fs, result["run_dir"])) == 3


def test_a_checkpoint_on_s3_loads_for_model_logging_and_export(
    s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No Ray: the driver's read of a checkpoint folder on S3 (what the model logged to
    MLflow and ``raytrain export`` load). pyarrow's ``copy_files`` of a folder does not
    create the destination folder, which every read of an S3 checkpoint tripped on."""
    import torch

    from raytrain.checkpoints.export import checkpoint_weights, trained_model
    from raytrain.models.digits import DigitsCNN
    from raytrain.spec import JobSpec, StorageSpec
    from tests.integration.s3_server import S3_ENV, s3_client

    for key, value in S3_ENV.items():  # the standard chain, as a driver's would be
        monkeypatch.setenv(key, value)
    s3_client(s3_endpoint).create_bucket(Bucket="raytrain-ckpt")
    model = DigitsCNN()
    local = tmp_path / "checkpoint_000003"
    local.mkdir()
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, local / "checkpoint.ckpt")
    (local / "raytrain.json").write_text("{}")
    pafs.copy_files(str(local), "raytrain-ckpt/runs/x/checkpoint_000003",
                    destination_filesystem=s3_filesystem(s3_endpoint))  # fmt: skip
    uri = "s3://raytrain-ckpt/runs/x/checkpoint_000003"
    options = StorageSpec(s3={"endpoint_url": s3_endpoint, "region": "us-east-1"})
    weights = checkpoint_weights(uri, options)
    assert weights.keys() == model.state_dict().keys()
    job = JobSpec.model_validate({
        "name": "x", "model": {"class_path": "raytrain.models.digits:DigitsCNN"},
        "data": {"train": {"uri": str(tmp_path)}},
        "storage": {"s3": {"endpoint_url": s3_endpoint, "region": "us-east-1"}},
    })  # fmt: skip
    pixels = torch.rand(2, 64) * 16
    with torch.no_grad():
        assert torch.equal(trained_model(job, uri)(pixels), model.eval()(pixels))
