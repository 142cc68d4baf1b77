"""The digits job run as a user runs it: ``raytrain run`` in a fresh process, against the
test S3 server, with credentials only in the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs

from tests.integration.s3_server import S3_ENV

ROOT = Path(__file__).resolve().parents[2]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI run against the test server: its credentials, no cluster."""
    env = {**os.environ, **S3_ENV, "PYTHONPATH": str(ROOT), **extra}
    env.pop("RAY_ADDRESS", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def run_cli(env: dict[str, str], cwd: Path, *args: str, timeout: float = 600) -> tuple:
    """``raytrain run jobs/digits.yaml ARGS --json``: (exit code, parsed result, stderr)."""
    cmd = [
        sys.executable,
        "-m",
        "raytrain",
        "run",
        str(ROOT / "jobs" / "digits.yaml"),
        "--json",
        "data.prepare=null",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    return proc.returncode, result, proc.stdout + proc.stderr


def digits_on_s3(bucket: str, runs: str) -> list[str]:
    return [
        f"data.train.uri={bucket}/digits/train",
        f"data.val.uri={bucket}/digits/val",
        f"checkpoint.storage={bucket}/{runs}",
    ]


def checkpoint_dirs(fs: pafs.FileSystem, run_dir: str) -> list[str]:
    infos = fs.get_file_info(pafs.FileSelector(run_dir.removeprefix("s3://")))
    return sorted(
        i.base_name
        for i in infos
        if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_")
    )
