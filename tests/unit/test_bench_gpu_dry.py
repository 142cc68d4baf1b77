"""bench/gpu_throughput.py's dry run: on a machine without a GPU, everything but its CUDA
parts runs in seconds (the plain loop trains a tiny GPT on the CPU; the raytrain side's data
and spec pass ``raytrain.validate`` and build the model), so the GPU benchmark is known to
work up to them. No Ray: the dry run's ``--ray`` (``raytrain.fit`` on a CPU worker) is not
run here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_benchmark_dry_run_trains_and_checks_the_raytrain_side(tmp_path: Path) -> None:
    out = tmp_path / "gpu-dry.json"
    done = subprocess.run(
        [sys.executable, "bench/gpu_throughput.py", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "raytrain.fit not run" in done.stdout
    record = json.loads(out.read_text())
    assert record["dry_run"] is True
    assert record["gpt"] == {"block": 16, "layers": 1, "heads": 2, "dim": 32}
    assert record["parameters"] > 0
    assert record["plain"]["tokens_per_s"] > 0
    assert record["plain"]["peak_memory_gb"] is None  # not measured on a CPU
    assert record["raytrain"] is None


def test_without_a_gpu_the_full_benchmark_refuses_with_a_hint() -> None:
    import torch

    if torch.cuda.is_available():  # pragma: no cover - a GPU machine runs the real thing
        pytest.skip("this machine has a GPU")
    done = subprocess.run(
        [sys.executable, "bench/gpu_throughput.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "needs a CUDA GPU" in done.stderr and "--dry-run" in done.stderr
