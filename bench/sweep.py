"""A sweep's cost per trial against a lone ``raytrain run`` of the same trial.

The trial: the digits CNN on 1 worker, 4 epochs, validation and a checkpoint every epoch.
The lone run is ``raytrain run`` as a fresh command (its own embedded Ray). The sweep is
``raytrain tune`` of the same spec with 4 trials (a grid over the file each trial's step
clock writes: 4 copies of the one trial), once with 1 trial at a time and once with 2. All
of them share the sweep's one Ray cluster. Figures, each a median over ``--reps``:

- wall per trial: the lone command's launch to exit; the sweep command's, divided by 4;
- startup: from the run's MLflow run opening to its first optimizer step (in a trial, the
  moment its actor started the run), and for the lone run also from the launch;
- per-epoch overhead and step time, from the same clock as bench/overhead.py.

    python -m bench.sweep [--reps 2] [--out bench/results/sweep.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.overhead import _env  # noqa: E402
from bench.timed import MODELS, summarize  # noqa: E402

TRIALS, EPOCHS = 4, 4


def _spec(data: Path, work: Path, name: str, timing: str) -> dict[str, Any]:
    config = MODELS["digits"]
    return {
        "name": name,
        "model": {
            "class_path": "bench.timed:TimedDigitsCNN",
            "init_args": {**config["init_args"], "timing_path": timing},
        },
        "data": {
            "train": {"uri": str(data / "train")},
            "val": {"uri": str(data / "val")},
            "columns": ["pixels", "label"],
            "batch_size": config["batch_size"],
        },
        "scaling": {"num_workers": 1},
        "trainer": {"max_epochs": EPOCHS, "precision": "32-true", "log_every_n_steps": 10},
        "checkpoint": {"storage": str(work / "runs"), "every_n_epochs": 1, "keep": 1},
        "tracking": {
            "mlflow": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}", "log_model": False}
        },
    }


def _run_started(work: Path, run_id: str) -> float:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    return client.get_run(run_id).info.start_time / 1000


def _command(cmd: list[str], work: Path) -> tuple[float, float, dict[str, Any]]:
    launched = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=900)
    exited = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return launched, exited, json.loads(proc.stdout.strip().splitlines()[-1])


def lone(data: Path, work: Path) -> dict[str, float]:
    timing = work / "lone.json"
    path = work / "lone.json.spec"
    path.write_text(json.dumps(_spec(data, work, "lone", str(timing))))
    launched, exited, result = _command(
        [sys.executable, "-m", "raytrain", "run", str(path), "--json"], work
    )
    clock = json.loads(timing.read_text())
    figures = summarize(clock, launched)
    opened = _run_started(work, result["mlflow_run_id"])
    first_step = next(s[0] for s in clock["step_ends"] if s)
    return {
        "wall_per_trial_s": exited - launched,
        "startup_s": first_step - opened,
        "launch_to_first_step_s": figures["startup_s"],
        "epoch_overhead_s": figures["epoch_overhead_s"],
        "step_s": figures["step_s"],
    }


def sweep(data: Path, work: Path, concurrent: int) -> dict[str, float]:
    timings = [str(work / f"trial-{concurrent}-{i}.json") for i in range(TRIALS)]
    spec = _spec(data, work, f"sweep-{concurrent}", timings[0])
    spec["tune"] = {
        "search_space": {"model.init_args.timing_path": {"grid": timings}},
        "metric": "val_acc",
        "mode": "max",
        "max_concurrent_trials": concurrent,
    }
    path = work / f"sweep-{concurrent}.json.spec"
    path.write_text(json.dumps(spec))
    launched, exited, result = _command(
        [sys.executable, "-m", "raytrain", "tune", str(path), "--json"], work
    )
    startups, overheads, steps = [], [], []
    for trial in result["trials"]:
        clock = json.loads(Path(trial["values"]["model.init_args.timing_path"]).read_text())
        figures = summarize(clock, launched)
        first_step = next(s[0] for s in clock["step_ends"] if s)
        startups.append(first_step - _run_started(work, trial["mlflow_run_id"]))
        overheads.append(figures["epoch_overhead_s"])
        steps.append(figures["step_s"])
    return {
        "wall_per_trial_s": (exited - launched) / TRIALS,
        "startup_s": statistics.median(startups),
        "epoch_overhead_s": statistics.median(overheads),
        "step_s": statistics.median(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "sweep.json"))
    args = parser.parse_args()
    from raytrain.datasets.digits import write_splits

    rows: dict[str, list[dict[str, float]]] = {
        "lone run": [],
        "sweep, 1 at a time": [],
        "sweep, 2 at a time": [],
    }
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-sweep-") as tmp:
        data = Path(tmp) / "data"
        write_splits(str(data / "train"), str(data / "val"))
        for rep in range(args.reps):
            work = Path(tmp) / f"rep{rep}"
            work.mkdir()
            rows["lone run"].append(lone(data, work))
            rows["sweep, 1 at a time"].append(sweep(data, work, 1))
            rows["sweep, 2 at a time"].append(sweep(data, work, 2))
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    medians = {
        label: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for label, runs in rows.items()
    }
    base = medians["lone run"]
    print(f"| {'':<20} | wall per trial (s) | startup (s) | per-epoch overhead (s) | step (ms) |")
    print("|---|---|---|---|---|")
    for label, m in medians.items():
        ratio = m["wall_per_trial_s"] / base["wall_per_trial_s"]
        cells = [
            f"{m['wall_per_trial_s']:.1f} ({ratio:.2f}x)",
            f"{m['startup_s']:.1f}",
            f"{m['epoch_overhead_s']:.3f}",
            f"{1000 * m['step_s']:.2f}",
        ]
        print(f"| {label:<20} | " + " | ".join(cells) + " |")
    print(f"lone run, launch to first step: {base['launch_to_first_step_s']:.1f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"medians": medians, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
