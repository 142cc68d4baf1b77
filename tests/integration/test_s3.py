"""The digits job with its data and checkpoints on a real S3 API server, then resumed there.

The runs are fresh CLI processes with the server in ``AWS_ENDPOINT_URL`` (the standard
variable, read by pyarrow and by Ray Train), so each embedded Ray's processes inherit it, as
a cluster's nodes would have their credentials.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tests.integration.s3_server import S3_ENV, moto_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _run(env: dict[str, str], cwd: Path, *overrides: str) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "raytrain.cli", "run", str(ROOT / "jobs" / "digits.yaml"),
           "--json", "data.prepare=null", "data.train.uri=s3://raytrain-test/digits/train",
           "data.val.uri=s3://raytrain-test/digits/val", "checkpoint.storage=s3://raytrain-test/runs",
           *overrides]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_digits_on_s3_trains_and_resumes_from_s3(
    digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    with moto_server(tmp_path / "moto.log") as endpoint:
        env = {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": endpoint,
               "PYTHONPATH": str(ROOT)}  # fmt: skip
        env.pop("RAY_ADDRESS", None)
        fs = pafs.S3FileSystem(
            endpoint_override=endpoint, access_key="testing", secret_key="testing",
            region="us-east-1", allow_bucket_creation=True,
        )  # fmt: skip
        fs.create_dir("raytrain-test")
        local = pafs.LocalFileSystem()
        pafs.copy_files(str(digits_dir), "raytrain-test/digits", local, fs)

        first, _ = _run(env, tmp_path)
        assert first["metrics"]["val_acc"] >= 0.95
        assert first["best_checkpoint_uri"].startswith("s3://raytrain-test/runs/digits-cnn/")
        ckpt = first["latest_checkpoint_uri"].removeprefix("s3://")
        names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(ckpt))}
        assert {"checkpoint.ckpt", "raytrain.json"} <= names  # the checkpoint is on S3
        assert not (tmp_path / "runs").exists()  # and nothing of it local

        second, stderr = _run(env, tmp_path, "trainer.max_epochs=11")
        assert f"resuming digits-cnn from {first['latest_checkpoint_uri']}" in stderr
        assert second["metrics"]["step"] == first["metrics"]["step"] + 23  # one more epoch
        assert second["mlflow_run_id"] == first["mlflow_run_id"]
