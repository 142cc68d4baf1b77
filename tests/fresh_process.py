"""Code run in a fresh interpreter, as a user's command runs: nothing the test session
imported is loaded there, so a test can see what the command itself imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_fresh(code: str, arg: Any, cwd: Path, *, pythonpath: str, timeout: float) -> Any:
    """Run ``code`` with ``json.dumps(arg)`` as its one argument, in ``cwd``, with no cluster
    or tracking server inherited; returns the JSON its last line of output prints."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(arg)],
        capture_output=True,
        text=True,
        timeout=timeout,
        # the caller's PYTHONPATH after ``pythonpath``: a worktree's raytrain stays first
        env={
            **env,
            "RAY_ADDRESS": "",
            "PYTHONPATH": os.pathsep.join(
                p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p
            ),
        },
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
