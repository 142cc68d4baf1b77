"""Recovery from worker failures: time from a kill to the next training step, steps trained
again, and the final val_acc beside an uninterrupted run with the same seed.

The digits job with 2 workers, 10 epochs, a checkpoint every epoch and
``failure.max_failures: 3``, run three ways in one process on one embedded Ray: without
failures (the baseline), and with rank 1 SIGKILLed at 3 steps, twice:

- ``any time``: the kill comes whenever the step is reached. A checkpoint reported less than
  one controller poll (0.5 s) before the kill may not be committed yet; the run then
  restores from the one before, and trains more steps again.
- ``after commit``: each kill waits until Ray Train has committed the worker's last
  checkpoint, so the restore is from it: what a failure long after a checkpoint costs.

With ``--memory N|auto`` (``checkpoint.memory_every_n_steps``) it runs, instead: ``--repeat``
uninterrupted runs with the state kept in every other block of ``--toggle-every`` steps
(the overhead: each block that keeps against the one before that does not, in the same
run; two runs on 2 shared cores differ by 30% and more, which paired runs charged to the
state), and kills at any time without and with it: steps trained again per kill.
``--strategy fsdp|tp2`` runs those four on the tiny GPT (the FSDP test's, 2 workers)
under sharded FSDP, or tensor parallelism of 2 (``model_parallel``), where every rank
keeps its shard.

The model (tests/integration/models.py, ``KillAtStepsCNN``, ``KillAtStepsGPT``) records
wall-clock times of each kill and of the first step finished after each (re)start. It
prints a table and writes JSON.

With ``--warm`` the embedded Ray keeps a pool of warm worker processes (torch and
Lightning imported, ``driver.warm_pool``), as ``raytrain up`` does, and each run starts
once the pool is ready: a replacement worker then starts in one of them if the pool has
refilled since the run began (it refills one process at a time).

    python -m bench.recovery [--kills 40,100,170] [--memory auto] [--width 128,32]
                             [--strategy ddp|fsdp|tp2] [--repeat N] [--toggle-every N]
                             [--warm] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _run(
    work: Path,
    name: str,
    kills: list[int],
    wait_for_commit: bool,
    memory: int | str | None = None,
    width: tuple[int, int] = (16, 64),
    strategy: str = "ddp",
    toggle_every: int = 0,
) -> dict:
    import raytrain

    out = work / name
    out.mkdir()
    channels, hidden = width
    init: dict = {
        "out_dir": str(out),
        "at_steps": kills,
        "lr": 0.002,
        "channels": channels,
        "hidden": hidden,
        "toggle_every": toggle_every,
    }
    if wait_for_commit:
        init["run_dir"] = str(out / "runs" / name)
    spec = {
        "name": name,
        "model": {"class_path": "tests.integration.models:KillAtStepsCNN", "init_args": init},
        "data": {
            "train": {"uri": str(work / "digits" / "train")},
            "val": {"uri": str(work / "digits" / "val")},
            "columns": ["pixels", "label"],
            "batch_size": 32,
        },
        "trainer": {"max_epochs": 10, "log_every_n_steps": 10, "seed": 42},
        **_gpt(work, init, strategy),
        # null: storage only (the default is auto)
        "checkpoint": {
            "storage": str(out / "runs"),
            "every_n_epochs": 1,
            "keep": 3,
            "memory_every_n_steps": memory,
        },
        "failure": {"max_failures": len(kills)},
        "tracking": {"mlflow": {"tracking_uri": f"sqlite:///{out / 'mlflow.db'}"}},
    }
    result = raytrain.fit(spec, progress=False)
    events = sorted(
        (json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()),
        key=lambda e: e["at"],
    )
    recoveries = []
    for i, event in enumerate(events):
        if event["event"] != "kill":
            continue
        nxt = next(e for e in events[i + 1 :] if e["event"] == "first_step")
        restored = nxt["step"] - 1
        recoveries.append(
            {
                "kill_step": event["step"],
                "restored_from_step": restored,
                "steps_trained_again": event["step"] - restored,
                "kill_to_next_step_s": nxt["at"] - event["at"],
            }
        )
    metric = "val_acc" if strategy == "ddp" else "val_bpc"
    return {
        "val_acc": result.metrics[metric],
        "step": result.metrics["step"],
        "wall_s": result.wall_time_s,
        "recoveries": recoveries,
        **_throughput(result),
        **_toggled(events, toggle_every),
    }


def _toggled(events: list[dict], every: int) -> dict:
    """With ``toggle_every``: the cost of keeping the state, measured within the run. Each
    step's time is the time between rank 0's step ends; a block's is the median of its
    steps but the first (which may hold the block before's last write or send); each
    block that keeps is set against the block before it, which does not. Returns the
    median of those ratios less one (the overhead) and each ratio."""
    if not every:
        return {}
    ends = [e for e in events if e["event"] == "step_end"]
    blocks: dict[int, list[float]] = {}
    for before, after in itertools.pairwise(ends):
        if after["step"] == before["step"] + 1 and (after["step"] - 1) % every:
            blocks.setdefault((after["step"] - 1) // every, []).append(
                after["at_perf"] - before["at_perf"]
            )
    ratios = [
        statistics.median(blocks[b]) / statistics.median(blocks[b - 1])
        for b in sorted(blocks)
        if b % 2 == 1 and b - 1 in blocks
    ]
    return {
        "toggle_every": every,
        "block_ratios": ratios,
        "toggled_overhead": statistics.median(ratios) - 1 if ratios else None,
    }


GPT = {"block": 128, "layers": 2, "heads": 2, "dim": 32, "lr": 0.003}  # the FSDP test's


def _gpt(work: Path, init: dict, strategy: str) -> dict:
    """The spec's model, data, trainer and strategy for the tiny GPT under ``strategy``
    (nothing under ddp: the digits job). Its text is written once, under ``work``."""
    if strategy == "ddp":
        return {}
    from raytrain.datasets.text import write_splits

    text = work / "text"
    if not text.exists():  # 78 steps an epoch on 2 data-parallel workers of 16 rows
        write_splits(str(text / "train"), str(text / "val"), 200_000)
    gpt = {k: v for k, v in init.items() if k not in ("lr", "channels", "hidden")}
    parallel = {"name": "fsdp", "fsdp": {"auto_wrap": ["Block"]}}
    epochs = 3
    if strategy == "tp2":  # one replica of 2 ranks: 156 steps an epoch
        parallel = {"name": "model_parallel", "model_parallel": {"tensor_parallel_size": 2}}
        epochs = 2
    return {
        "model": {
            "class_path": "tests.integration.models:KillAtStepsGPT",
            "init_args": {**gpt, **GPT},
        },
        "data": {
            "train": {"uri": str(text / "train")},
            "val": {"uri": str(text / "val")},
            "columns": ["tokens"],
            "batch_size": 16,
        },
        "trainer": {
            "max_epochs": epochs,
            "log_every_n_steps": 10,
            "seed": 42,
            "precision": "32-true",
        },
        "strategy": parallel,
    }


def _throughput(result: object) -> dict:
    """The run's median ``samples_per_second`` over its reports, and what keeping the
    in-memory state cost by its own figures (``auto``'s last choice, or a set interval's
    cost: the MLflow tag), from the run's MLflow record."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(result.tracking_uri)  # type: ignore[attr-defined]
    run_id = result.mlflow_run_id  # type: ignore[attr-defined]
    rates = [m.value for m in client.get_metric_history(run_id, "samples_per_s")]
    tags = client.get_run(run_id).data.tags
    return {
        "samples_per_second": statistics.median(rates) if rates else None,
        "memory_interval": tags.get("raytrain.memory_interval"),
    }


def _memory_table(results: dict) -> None:
    """Steps trained again per kill, kill -> next step, and the overhead of the state."""
    print(
        f"{'state':<10} {'kills':>5} {'retrained (each)':<26} {'median':>6} "
        f"{'kill->step s (median)':>22}"
    )
    for name in ("storage only", "memory"):
        recs = results[f"{name} any time"]["recoveries"]
        again = [r["steps_trained_again"] for r in recs]
        times = [r["kill_to_next_step_s"] for r in recs]
        print(
            f"{name:<10} {len(recs):>5} {','.join(map(str, again)):<26} "
            f"{statistics.median(again):>6} {statistics.median(times):>22.2f}"
        )
    overheads = [o for o in results["overheads"] if o is not None]
    each = ", ".join(f"{100 * o:+.1f}%" for o in overheads)
    every = results["memory uninterrupted"]["toggle_every"]
    print(
        f"overhead of the state, blocks of {every} steps with it against blocks without, "
        f"in each of {len(overheads)} runs: {each}; median "
        f"{100 * statistics.median(overheads):+.1f}%"
    )
    print(f"the state's own figures: {results['memory uninterrupted']['memory_interval']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", default="40,100,170", help="steps at which rank 1 is killed")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "recovery.json"))
    parser.add_argument(
        "--width",
        default="16,64",
        help="the CNN's channels,hidden: 16,64 is the digits job; 128,32 a compute-bound "
        "step (25x the convolution work, a state of the same order)",
    )
    parser.add_argument(
        "--memory",
        default=None,
        help="checkpoint.memory_every_n_steps (N or auto): compare with it",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="with --memory: uninterrupted runs, each measuring the overhead within itself "
        "(--toggle-every); their median",
    )
    parser.add_argument(
        "--strategy",
        default="ddp",
        choices=["ddp", "fsdp", "tp2"],
        help="ddp: the digits CNN; fsdp, tp2: the tiny GPT, sharded (with --memory)",
    )
    parser.add_argument(
        "--toggle-every",
        type=int,
        default=10,
        help="with --memory: the overhead's blocks, in steps (the state kept in every other)",
    )
    parser.add_argument(
        "--warm", action="store_true", help="keep a pool of warm processes, as raytrain up does"
    )
    args = parser.parse_args()
    kills = [int(k) for k in args.kills.split(",")]
    channels, hidden = (int(v) for v in args.width.split(","))
    width = (channels, hidden)
    memory = (
        None
        if args.memory is None
        else (args.memory if args.memory == "auto" else int(args.memory))
    )

    from raytrain.datasets.digits import write_splits
    from raytrain.driver.ray_runtime import DATA_CPUS, start_local

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_splits(str(work / "digits" / "train"), str(work / "digits" / "val"))
        if args.warm:
            from raytrain.driver.local_cluster import default_warm
            from raytrain.worker.warm_ready import WARM_DIR_ENV

            marks = work / "warm"
            marks.mkdir()
            os.environ[WARM_DIR_ENV] = str(marks)
            handle = start_local(2 + DATA_CPUS, warm=default_warm(2 + DATA_CPUS), warm_marks=marks)
        else:
            handle = start_local(2 + DATA_CPUS)

        def run(*a: object, **kw: object) -> dict:  # each run starts on a full pool
            if handle.pool is not None and handle.pool.marks is not None:
                handle.pool.wait_ready(180)
            return _run(*a, **kw)  # type: ignore[arg-type]

        if memory is not None:
            how = {"width": width, "strategy": args.strategy}
            toggled = [
                run(work, f"toggled-{i}", [], False, memory, **how, toggle_every=args.toggle_every)
                for i in range(args.repeat)
            ]
            results = {
                "memory uninterrupted": toggled[0],
                "toggled": toggled,
                "storage only any time": run(work, "off-kills", kills, False, None, **how),
                "memory any time": run(work, "on-kills", kills, False, memory, **how),
                "overheads": [t["toggled_overhead"] for t in toggled],
            }
            handle.shutdown()
            _memory_table(results)
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(
                json.dumps(
                    {
                        "kills": kills,
                        "memory": memory,
                        "width": width,
                        "strategy": args.strategy,
                        "results": results,
                    },
                    indent=2,
                )
            )
            print(f"wrote {out}")
            return
        results = {
            "uninterrupted": run(work, "uninterrupted", [], False),
            "any time": run(work, "any-time", kills, False),
            "after commit": run(work, "after-commit", kills, True),
        }
        handle.shutdown()

    base = results["uninterrupted"]
    print(f"{'kills':<14} {'kill step':>9} {'restored':>9} {'retrained':>10} {'kill->step s':>13}")
    print("-" * 59)
    for variant in ("any time", "after commit"):
        for r in results[variant]["recoveries"]:
            print(
                f"{variant:<14} {r['kill_step']:>9} {r['restored_from_step']:>9} "
                f"{r['steps_trained_again']:>10} {r['kill_to_next_step_s']:>13.2f}"
            )
    print()
    print(f"{'run':<14} {'val_acc':>8} {'steps':>6} {'wall s':>7} {'median kill->step s':>20}")
    for variant, res in results.items():
        times = [r["kill_to_next_step_s"] for r in res["recoveries"]]
        median = f"{statistics.median(times):.2f}" if times else "-"
        print(
            f"{variant:<14} {res['val_acc']:>8.4f} {res['step']:>6} {res['wall_s']:>7.1f} "
            f"{median:>20}"
        )
    for variant in ("any time", "after commit"):
        gap = results[variant]["val_acc"] - base["val_acc"]
        print(f"val_acc {variant} - uninterrupted: {gap:+.4f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"kills": kills, "warm": args.warm, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
