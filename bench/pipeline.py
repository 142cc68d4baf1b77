"""The pipeline's bubble, measured against theory: per schedule (GPipe, 1F1B) and
micro-batch count m at p = 2 stages, the step time and the fraction of it a stage waits.

    python bench/pipeline.py [--dim 1024 --layers 8 --rows 64 --steps 6]

Two gloo processes (one thread each: one core per stage, as on this 2-core machine) run
``torch.distributed.pipelining``'s schedules over raytrain's ``ChainStage`` of a stack of
``--layers`` Linear+ReLU blocks, cut in half. A micro-batch has ``--rows`` rows whatever
m is, so a stage's work per micro-batch, t, is the same in every row of the table: a step
moves m micro-batches and would take m t per stage with no bubble. Each stage measures t
itself (its forward and backward on one micro-batch, no communication, the median of 10)
and the larger of the two is used. The measured bubble is 1 - m t / T, T the median step
time; the theory's is (p - 1) / (m + p - 1). What the measured adds to the theory is the
sends and receives between the stages and the schedule's own work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STAGES = 2
SCHEDULES = ("gpipe", "1f1b")
MICROBATCHES = (2, 4, 8)


def theory(m: int, p: int = STAGES) -> float:
    """GPipe's bubble fraction (1F1B's is the same): (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


def _stage(rank: int, dim: int, layers: int) -> Any:
    import torch
    from torch import nn

    from raytrain.pipeline.stage import ChainStage

    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)
    )
    half = layers // STAGES
    paths = [f"blocks.{i}" for i in range(rank * half, (rank + 1) * half)]
    return ChainStage(model, paths)


def _compute_time(stage: Any, rows: int, dim: int) -> float:
    """One micro-batch's forward and backward through ``stage`` alone, median of 10."""
    import torch

    x = torch.randn(rows, dim, requires_grad=True)
    times = []
    for _ in range(12):
        start = time.perf_counter()
        stage(x).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def _worker(rank: int, port: int, args: Any, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    stage_module = _stage(rank, args.dim, args.layers)
    t = torch.tensor(_compute_time(stage_module, args.rows, args.dim))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slower stage sets the pace
    rows: list[dict[str, Any]] = []
    for name in SCHEDULES:
        for m in MICROBATCHES:
            kind = ScheduleGPipe if name == "gpipe" else Schedule1F1B
            stage = PipelineStage(stage_module, rank, STAGES, torch.device("cpu"))
            schedule = kind(stage, n_microbatches=m, loss_fn=lambda out, y: (out - y).pow(2).mean())
            x = torch.randn(m * args.rows, args.dim)
            times = []
            for _ in range(args.steps + 2):
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=torch.zeros_like(x))
                times.append(time.perf_counter() - start)
            step = torch.tensor(statistics.median(times[2:]))
            dist.all_reduce(step, op=dist.ReduceOp.MAX)
            measured = 1 - m * float(t) / float(step)
            rows.append(
                {
                    "schedule": name,
                    "m": m,
                    "step_s": float(step),
                    "micro_s": float(t),
                    "bubble": measured,
                    "theory": theory(m),
                }
            )
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def measure(args: Any) -> list[dict[str, Any]]:
    import tempfile

    import torch.multiprocessing as mp

    from bench.ddp_baseline import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(_worker, args=(port, args, out), nprocs=STAGES)
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "pipeline.json"))
    args = parser.parse_args()
    rows = measure(args)
    print(f"p = {STAGES}, a micro-batch of {args.rows} rows; t = {rows[0]['micro_s'] * 1e3:.1f} ms")
    header = f"{'schedule':<9}{'m':>3}{'step, ms':>10}{'m t, ms':>9}{'bubble':>8}{'theory':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['schedule']:<9}{row['m']:>3}{row['step_s'] * 1e3:>10.1f}"
            f"{row['m'] * row['micro_s'] * 1e3:>9.1f}{row['bubble']:>8.2f}{row['theory']:>8.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
