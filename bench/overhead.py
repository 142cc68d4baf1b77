"""raytrain beside a hand-written torch DDP loop: per-step, startup and per-epoch overhead.

Both sides train the same model on the same data for the same epochs with 2 workers, the
same per-worker batch, one thread per worker, validation and a checkpoint every epoch. Both
run as fresh commands, so startup counts from the command's launch to its first step. The
figures come from the same clock code (bench/timed.py); medians over ``--reps`` repetitions.

    python bench/overhead.py [--reps 2] [--models digits,compute] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.timed import MODELS, summarize  # noqa: E402

EPOCHS = {"digits": 4, "compute": 8}
SHUFFLE: dict | None = {"seed": 0}
FIGURES = ("step_s", "startup_s", "epoch_overhead_s", "wall_s")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(cmd: list[str], timing: Path) -> dict[str, float]:
    launched = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return summarize(json.loads(timing.read_text()), launched)


def run_baseline(model: str, data: Path, work: Path) -> dict[str, float]:
    timing = work / f"baseline-{model}.json"
    cmd = [sys.executable, str(ROOT / "bench" / "ddp_baseline.py"), "--model", model,
           "--epochs", str(EPOCHS[model]), "--data", str(data), "--out", str(timing)]  # fmt: skip
    return _run(cmd, timing)


def run_raytrain(model: str, data: Path, work: Path) -> dict[str, float]:
    import yaml

    timing = work / f"raytrain-{model}.json"
    config = MODELS[model]
    spec = {
        "name": f"bench-{model}",
        "model": {
            "class_path": "bench.timed:TimedDigitsCNN",
            "init_args": {**config["init_args"], "timing_path": str(timing)},
        },
        "data": {
            "train": {"uri": str(data / "train")},
            "val": {"uri": str(data / "val")},
            "columns": ["pixels", "label"],
            "batch_size": config["batch_size"],
            "shuffle": SHUFFLE,
        },
        "scaling": {"num_workers": 2},
        "trainer": {"max_epochs": EPOCHS[model], "gradient_clip_val": 1.0,
                    "log_every_n_steps": 10, "seed": 42},
        "checkpoint": {"storage": str(work / "runs"), "every_n_epochs": 1, "keep": 1},
        "tracking": {"mlflow": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}"}},
    }  # fmt: skip
    path = work / f"{model}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return _run([sys.executable, "-m", "raytrain.cli", "run", str(path), "--fresh"], timing)


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in FIGURES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--models", default="digits,compute")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.json"))
    args = parser.parse_args()

    from raytrain.datasets.digits import write_splits

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-") as tmp:
        work = Path(tmp)
        data = work / "digits"
        write_splits(str(data / "train"), str(data / "val"))
        for model in args.models.split(","):
            runs: dict[str, list] = {"raytrain": [], "baseline": []}
            for rep in range(args.reps):
                # alternate the order so neither side always runs on a warmer machine
                order = ["baseline", "raytrain"] if rep % 2 == 0 else ["raytrain", "baseline"]
                for side in order:
                    fn = run_baseline if side == "baseline" else run_raytrain
                    runs[side].append(fn(model, data, work))
                    print(f"  {model} {side} rep {rep + 1}: "
                          + ", ".join(f"{k}={v:.3f}" for k, v in runs[side][-1].items()),
                          file=sys.stderr, flush=True)  # fmt: skip
            med = {side: _median(r) for side, r in runs.items()}
            ratio = {k: med["raytrain"][k] / med["baseline"][k] for k in FIGURES}
            results[model] = {"raytrain": med["raytrain"], "baseline": med["baseline"],
                              "ratio": ratio, "epochs": EPOCHS[model],
                              "batch_size": MODELS[model]["batch_size"], "runs": runs}  # fmt: skip

    header = f"{'model':<9} {'figure':<22} {'raytrain':>10} {'baseline':>10} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    labels = {"step_s": "step (ms)", "startup_s": "startup to 1st step (s)",
              "epoch_overhead_s": "per-epoch overhead (s)", "wall_s": "end to end (s)"}  # fmt: skip
    for model, res in results.items():
        for key in FIGURES:
            scale = 1000 if key == "step_s" else 1
            print(f"{model:<9} {labels[key]:<22} {res['raytrain'][key] * scale:>10.2f} "
                  f"{res['baseline'][key] * scale:>10.2f} {res['ratio'][key]:>7.2f}")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"reps": args.reps, "workers": 2, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
