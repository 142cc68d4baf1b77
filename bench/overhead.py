"""raytrain beside a hand-written torch DDP loop: per-step, startup and per-epoch overhead.

Both sides train the same model on the same data for the same epochs with 2 workers, the
same per-worker batch, one thread per worker, validation and a checkpoint every epoch. Both
run as fresh commands, so startup counts from the command's launch to its first step and end
to end from launch to the command's exit. The step figures come from the same clock code
(bench/timed.py); every figure is a median over ``--reps`` repetitions, taken in one run.

Besides the default run (Ray sized by raytrain: the workers' CPUs + 2), raytrain's
per-epoch overhead is measured with Ray given 6 and 16 logical CPUs, and with the train set
in 32 files: an epoch's fixed cost must depend on neither. "warm" runs the same command on
a cluster ``raytrain up`` started (brought up before each repetition, so its pool of warm
worker processes is full, and stopped after). The startup breakdowns come from ``raytrain
run --json`` (``FitResult.timings``).

    python bench/overhead.py [--reps 3] [--models digits,compute] [--variants A,B]
                             [--out FILE.json]
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
FIGURES = ("step_s", "startup_s", "epoch_overhead_s", "exit_s")
LABELS = {
    "step_s": "step (ms)",
    "startup_s": "startup to 1st step (s)",
    "epoch_overhead_s": "per-epoch overhead (s)",
    "exit_s": "end to end (s)",
}
WARM = "warm"
# raytrain runs beside the default one: (label, logical CPUs given to Ray, train files,
# spec sections merged into the run's). Metrics are reported every 10 steps by default;
# every step measures what reporting costs. "DataModule" feeds the same rows from a
# LightningDataModule (TensorDatasets, the default collate) instead of the cached Parquet:
# its step time is compared with the default run's.
VARIANTS = {
    "digits": [
        ("Ray 6 CPUs", 6, 1, {}),
        ("Ray 16 CPUs", 16, 1, {}),
        ("Ray 16 CPUs, 32 files", 16, 32, {}),
        ("metrics every step", None, 1, {"trainer": {"log_every_n_steps": 1}}),
        ("DataModule", None, 1, {}),
        (WARM, None, 1, {}),
    ],
    "compute": [
        ("Ray 16 CPUs", 16, 1, {}),
        # the per-rank step timeline off: what measuring it costs a compute-bound step
        ("no timeline", None, 1, {"tracking": {"timeline": False}}),
        (WARM, None, 1, {}),
    ],
}
# FitResult.timings, in the order they happen: (key, what ends there)
PHASES = [
    ("fit_called", "python start + imports"),
    ("validated", "checks before Ray (spec, data footers)"),
    ("ray_ready", "Ray start (Ray Train, torch imported meanwhile)"),
    ("model_checked", "rest of those imports"),
    ("datasets_ready", "data read into the object store"),
    ("worker_started", "Ray Train controller -> worker processes"),
    ("train_loop_entered", "worker start (Ray, Ray Train, torch)"),
    ("lightning_imported", "worker imports Lightning, the model"),
    ("fit_started", "model, loaders, Lightning Trainer"),
    ("first_step", "Lightning fit start -> first step"),
]


def _env(cpus: int | None = None, home: Path | None = None) -> dict[str, str]:
    """The runs' environment: no cluster but the one ``home`` records (``raytrain up``'s
    record folder; None: a folder that holds none, so a cluster you have up is not used)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["RAYTRAIN_HOME"] = str(home or Path(tempfile.gettempdir()) / "raytrain-bench-no-cluster")
    if cpus is not None:
        env["RAYTRAIN_LOCAL_CPUS"] = str(cpus)
    return env


# A run that takes longer than this is stuck (a rank lost at rendezvous): it is retried once.
RUN_TIMEOUT_S = 300


def _run(cmd: list[str], timing: Path, env: dict[str, str]) -> tuple[dict[str, float], str]:
    for attempt in (1, 2):
        launched = time.time()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=RUN_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            print(
                f"  timed out after {RUN_TIMEOUT_S} s (attempt {attempt}): {' '.join(cmd)}",
                file=sys.stderr,
                flush=True,
            )
            continue
        exited = time.time()
        if proc.returncode == 0:
            figures = summarize(json.loads(timing.read_text()), launched)
            figures["exit_s"] = exited - launched
            return figures, proc.stdout
        print(
            f"  failed (attempt {attempt}): {' '.join(cmd)}\n{proc.stderr[-2000:]}",
            file=sys.stderr,
            flush=True,
        )
    raise SystemExit(f"{' '.join(cmd)} failed twice")


def run_baseline(model: str, data: Path, work: Path) -> dict[str, float]:
    timing = work / f"baseline-{model}.json"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "ddp_baseline.py"),
        "--model",
        model,
        "--epochs",
        str(EPOCHS[model]),
        "--data",
        str(data),
        "--out",
        str(timing),
    ]
    return _run(cmd, timing, _env())[0]


def run_raytrain(
    model: str,
    data: Path,
    work: Path,
    cpus: int | None = None,
    sections: dict | None = None,
    datamodule: bool = False,
    home: Path | None = None,
) -> dict[str, float]:
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
        "trainer": {
            "max_epochs": EPOCHS[model],
            "gradient_clip_val": 1.0,
            "log_every_n_steps": 10,
            "seed": 42,
        },
        "checkpoint": {"storage": str(work / "runs"), "every_n_epochs": 1, "keep": 1},
        "tracking": {"mlflow": {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}"}},
    }
    for section, values in (sections or {}).items():
        spec[section] = {**spec[section], **values}
    if datamodule:
        spec["model"]["class_path"] = "bench.timed:TimedDigitsTupleCNN"
        spec["data"] = {
            "class_path": "bench.timed.DigitsParquetModule",
            "init_args": {
                "train": str(data / "train"),
                "val": str(data / "val"),
                "batch_size": config["batch_size"],
            },
        }
        spec["trainer"]["seed"] = SHUFFLE["seed"] if SHUFFLE else 42
    path = work / f"{model}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cmd = [sys.executable, "-m", "raytrain", "run", str(path), "--fresh", "--json"]
    figures, stdout = _run(cmd, timing, _env(cpus, home))
    timings = json.loads(stdout.strip().splitlines()[-1])["timings"]
    # FitResult.timings count from fit()'s start; the first step ties them to the launch
    offset = figures["startup_s"] - timings["first_step"]
    figures.update({f"at_{key}": timings.get(key, 0.0) + offset for key, _ in PHASES[1:]})
    figures["at_fit_called"] = offset
    figures["at_tracking_ready"] = timings.get("tracking_ready", 0.0) + offset
    return figures


def write_data(root: Path, train_files: int) -> Path:
    """The digits splits under ``root``, the train split in ``train_files`` files."""
    import pyarrow.parquet as pq

    from raytrain.datasets.digits import write_splits

    write_splits(str(root / "train"), str(root / "val"))
    if train_files > 1:
        table = pq.read_table(root / "train")
        for old in (root / "train").iterdir():
            old.unlink()
        step = -(-table.num_rows // train_files)
        for i in range(train_files):
            part = table.slice(i * step, step)
            pq.write_table(part, root / "train" / f"part-{i:03d}.parquet")
    return root


def _cluster(command: str, home: Path) -> None:
    """``raytrain up`` (it returns once its warm processes are ready) or ``down``."""
    proc = subprocess.run(
        [sys.executable, "-m", "raytrain", command],
        capture_output=True,
        text=True,
        env=_env(home=home),
        cwd=ROOT,
        timeout=600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"raytrain {command} failed:\n{proc.stdout}{proc.stderr}")


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _bench_model(
    model: str, reps: int, work: Path, data: dict[int, Path], only: set[str] | None = None
) -> dict:
    chosen = [v for v in VARIANTS.get(model, []) if only is None or v[0] in only]
    variants = [("default", None, 1, {}), *chosen]
    runs: dict[str, list] = {"baseline": [], **{v[0]: [] for v in variants}}
    doctor = ""
    for rep in range(reps):
        # alternate the order so neither side always runs on a warmer machine
        sides = ["baseline", *(v[0] for v in variants)]
        for side in sides if rep % 2 == 0 else sides[::-1]:
            if side == "baseline":
                runs[side].append(run_baseline(model, data[1], work))
            elif side == WARM:
                home = work / "home"
                _cluster("up", home)
                try:
                    runs[side].append(run_raytrain(model, data[1], work, home=home))
                finally:
                    _cluster("down", home)
            else:
                _, cpus, files, sections = next(v for v in variants if v[0] == side)
                runs[side].append(
                    run_raytrain(
                        model, data[files], work, cpus, sections, datamodule=side == "DataModule"
                    )
                )
                if side == "default":  # what raytrain doctor makes of the run
                    doctor = _doctor(work / f"{model}.yaml")
            shown = {k: round(v, 3) for k, v in runs[side][-1].items() if not k.startswith("at_")}
            print(f"  {model} {side} rep {rep + 1}: {shown}", file=sys.stderr, flush=True)
    med = {side: _median(r) for side, r in runs.items()}
    raytrain, baseline = med["default"], med["baseline"]
    return {
        "raytrain": raytrain,
        "baseline": baseline,
        "ratio": {k: raytrain[k] / baseline[k] for k in FIGURES},
        "variants": {v[0]: med[v[0]] for v in variants[1:]},
        "epochs": EPOCHS[model],
        "batch_size": MODELS[model]["batch_size"],
        "runs": runs,
        "doctor": doctor,
    }


def _doctor(spec: Path) -> str:
    """``raytrain doctor``'s output for the run ``spec`` names (its last run)."""
    cmd = [sys.executable, "-m", "raytrain", "doctor", str(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    return proc.stdout if proc.returncode == 0 else f"doctor failed: {proc.stderr[-500:]}"


def _print_tables(results: dict[str, dict], reps: int) -> None:
    header = f"{'model':<9} {'figure':<44} {'raytrain':>10} {'baseline':>10} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for model, res in results.items():
        for key in FIGURES:
            scale = 1000 if key == "step_s" else 1
            print(
                f"{model:<9} {LABELS[key]:<44} {res['raytrain'][key] * scale:>10.2f} "
                f"{res['baseline'][key] * scale:>10.2f} {res['ratio'][key]:>7.2f}"
            )
        base = res["baseline"]
        for label, figures in res["variants"].items():
            if label == WARM:  # a cluster raytrain up started, against the hand-written DDP
                for key in ("startup_s", "exit_s", "step_s"):
                    k = 1000 if key == "step_s" else 1
                    print(
                        f"{model:<9} {LABELS[key] + ', warm':<44} {figures[key] * k:>10.2f} "
                        f"{base[key] * k:>10.2f} {figures[key] / base[key]:>7.2f}"
                    )
                continue
            key, scale = ("step_s", 1000) if "metrics" in label else ("epoch_overhead_s", 1)
            # the DataModule's step against raytrain's own (cached Parquet) step
            key, scale, against = (
                ("step_s", 1000, res["raytrain"]) if label == "DataModule" else (key, scale, base)
            )
            name = f"{LABELS[key].split(' (')[0]}, {label}"
            if label == "no timeline":  # raytrain's step (timeline on) over this one's
                figures, against, key, scale = res["raytrain"], figures, "step_s", 1000
                name = "time per step, timeline on / off"
                # each repetition's on and off runs ran back to back: the median of their
                # ratios leaves out the machine's drift between repetitions
                pairs = zip(res["runs"]["default"], res["runs"][label], strict=True)
                paired = statistics.median(on["step_s"] / off["step_s"] for on, off in pairs)
                print(
                    f"{model:<9} {'  (median of the repetitions ratios)':<44} {'':>10} "
                    f"{'':>10} {paired:>7.3f}"
                )
                if "interleaved" in res:  # bench/timeline_cost.py: inside the noise
                    mixed = res["interleaved"]
                    print(
                        f"{model:<9} {'  (DDP blocks on/off interleaved, median)':<44} "
                        f"{mixed['on_s'] * 1000:>10.2f} {mixed['off_s'] * 1000:>10.2f} "
                        f"{mixed['ratio']:>7.3f}"
                    )
            print(
                f"{model:<9} {name:<44} {figures[key] * scale:>10.2f} "
                f"{against[key] * scale:>10.2f} {figures[key] / against[key]:>7.2f}"
            )
    for model, res in results.items():
        print(f"\nraytrain doctor, {model} (the last repetition's raytrain run)")
        print(res["doctor"].rstrip())
    for model, res in results.items():
        cases = [("cold", res["raytrain"])]
        if WARM in res["variants"]:
            cases.append((WARM, res["variants"][WARM]))
        for case, figures in cases:
            print(
                f"\nstartup breakdown, {model}, {case} "
                f"(s from the command's launch, median of {reps})"
            )
            before = 0.0
            for key, what in PHASES:
                at = figures[f"at_{key}"]
                print(f"  {what:<46} {at - before:>6.2f}   (at {at:5.2f})")
                before = at
            print(
                f"  {'(MLflow run opened beside the workers, at)':<46} "
                f"{figures['at_tracking_ready']:>6.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models", default="digits,compute")
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated variant labels to run beside the default "
        "(e.g. DataModule); all when unset",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.json"))
    args = parser.parse_args()

    models = args.models.split(",")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-") as tmp:
        work = Path(tmp)
        files = {1} | {f for m in models for _, _, f, _ in VARIANTS.get(m, [])}
        data = {n: write_data(work / f"digits-{n}", n) for n in sorted(files)}
        for model in models:
            only = set(args.variants.split(",")) if args.variants else None
            results[model] = _bench_model(model, args.reps, work, data, only)
            if model == "compute" and (only is None or "no timeline" in only):
                # runs of one configuration spread by more than the timeline's cost here:
                # it is measured again with its on and off blocks side by side
                from bench.timeline_cost import measure

                results[model]["interleaved"] = measure(blocks=16, steps=30)

    _print_tables(results, args.reps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"reps": args.reps, "workers": 2, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
