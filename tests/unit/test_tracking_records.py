"""What raytrain puts in an MLflow run besides metrics: params with credentials removed, and
the git commit of the code that ran (from the checkout, or handed over by ``submit``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from raytrain.provenance import GIT_COMMIT_ENV, git_commit
from raytrain.redaction import REDACTED, redact
from raytrain.tracking.mlflow_tracker import redacted_params


def test_params_lose_credentials_and_keep_everything_else() -> None:
    params = redacted_params({
        "tracking.mlflow.tracking_uri": "https://alice:s3cret@mlflow.example.com/",
        "model.init_args.password": "hunter2",
        "model.init_args.api_key": "k-123",
        "model.init_args.max_tokens": 512,
        "model.init_args.lr": 0.002,
        "data.train.uri": "s3://bucket/train",
    })  # fmt: skip
    assert params == {
        "tracking.mlflow.tracking_uri": f"https://{REDACTED}@mlflow.example.com/",
        "model.init_args.password": REDACTED,
        "model.init_args.api_key": REDACTED,
        "model.init_args.max_tokens": "512",
        "model.init_args.lr": "0.002",
        "data.train.uri": "s3://bucket/train",
    }
    assert (
        redact("see http://u:p@h:5000 and http://h2")
        == f"see http://{REDACTED}@h:5000 and http://h2"
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="no git on this machine")
def test_the_commit_comes_from_the_checkout_or_from_submit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(GIT_COMMIT_ENV, raising=False)
    assert git_commit(str(tmp_path)) is None  # not a checkout

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git("rev-parse", "HEAD")
    assert git_commit(str(tmp_path)) == (head, False)
    (tmp_path / "a.txt").write_text("two")
    assert git_commit(str(tmp_path)) == (head, True)  # uncommitted changes
    monkeypatch.setenv(GIT_COMMIT_ENV, "abc123+dirty")  # what submit hands a job
    assert git_commit(str(tmp_path)) == ("abc123", True)
