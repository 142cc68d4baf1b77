"""Gradient compression per DDP communication hook on 2 workers: the bytes each rank
sends a step (counted in raytrain's hook), the step time, and on the digits model the
validation accuracy each reaches, against ``none`` (the fp32 all-reduce).

    python bench/comm_hooks.py [--epochs 8] [--big-steps 20]

Two gloo processes (one thread each) wrap each model in DistributedDataParallel and
register ``raytrain.worker.comm_hooks``'s hook with each ``strategy.ddp.comm_hook``: the
digits CNN (38k parameters) trained ``--epochs`` epochs on scikit-learn's digits (the
training split halved between the ranks, batch 32 each, Adam, seed 0), then evaluated
on the validation split; and an MLP of about 8.4M parameters (two 2048 x 2048 layers) on
random data for ``--big-steps`` steps, where communication is most of a step. PowerSGD:
rank 1, compressing from step 10.
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

HOOKS = ("none", "fp16", "bf16", "powersgd")


def _digits() -> tuple[Any, Any, Any, Any]:
    import numpy as np
    import torch

    from raytrain.datasets.digits import SPLIT_SEED, VAL_FRACTION, digits_table

    table = digits_table()
    pixels = torch.tensor(np.stack(table.column("pixels").to_numpy(zero_copy_only=False)))
    labels = torch.tensor(table.column("label").to_numpy())
    order = torch.from_numpy(np.random.default_rng(SPLIT_SEED).permutation(len(labels)))
    n_val = round(len(labels) * VAL_FRACTION)
    val, train = order[:n_val], order[n_val:]
    return pixels[train].float(), labels[train], pixels[val].float(), labels[val]


def _train(model: Any, batches: Any, state: Any) -> tuple[list[float], list[int]]:
    import torch

    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    times, sent = [], []
    for x, y in batches:
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        sent.append(state.take_bytes())
    return times, sent


def _batches(model_name: str, rank: int, args: Any) -> tuple[Any, list[Any]]:
    """The model (seed 0) and this rank's batches."""
    import torch

    from raytrain.models.digits import DigitsCNN

    torch.manual_seed(0)
    if model_name == "digits":
        x, y, _, _ = _digits()
        mine = torch.arange(rank, len(y), 2)
        generator = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(args.epochs):
            order = mine[torch.randperm(len(mine), generator=generator)]
            batches += [
                (x[order[i : i + 32]], y[order[i : i + 32]]) for i in range(0, len(order), 32)
            ]
        return DigitsCNN(), batches
    width = 2048
    net = torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )
    return net, [
        (torch.randn(16, width), torch.randint(0, 10, (16,))) for _ in range(args.big_steps)
    ]


def _worker(rank: int, port: int, model_name: str, hook: str, args: Any, out: str) -> None:
    """One (model, hook) pair in fresh processes: consecutive DDP models with different
    hooks in one gloo group once mismatched a collective's size here."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from raytrain.worker.comm_hooks import HookState, powersgd_state, register

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    net, batches = _batches(model_name, rank, args)
    from raytrain.worker.strategy import ONE_BUCKET_MB

    bucket_mb = args.bucket_mb or (ONE_BUCKET_MB if hook == "powersgd" else 25)
    model = DistributedDataParallel(net, bucket_cap_mb=bucket_mb)
    state = HookState(hook, powersgd_state(1, 10) if hook == "powersgd" else None)
    register(model, state)
    times, sent = _train(model, batches, state)
    row: dict[str, Any] = {
        "model": model_name,
        "hook": hook,
        "parameters": sum(p.numel() for p in net.parameters()),
        "bytes_per_step": statistics.median(sent[12:]),
        "step_s": statistics.median(times[12:]),
    }
    if model_name == "digits":
        _, _, vx, vy = _digits()
        with torch.no_grad():
            row["val_acc"] = float((net(vx).argmax(1) == vy).float().mean())
    if rank == 0:
        Path(out).write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's teardown may abort the interpreter (tests/unit/test_model_parallel)


def measure(args: Any) -> list[dict[str, Any]]:
    import tempfile

    import torch.multiprocessing as mp

    from bench.ddp_baseline import free_port

    rows = []
    for model_name in ("digits", "mlp"):
        for hook in HOOKS:
            port = free_port()
            with tempfile.TemporaryDirectory() as tmp:
                out = str(Path(tmp) / "row.json")
                mp.spawn(_worker, args=(port, model_name, hook, args, out), nprocs=2)
                rows.append(json.loads(Path(out).read_text()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--big-steps", type=int, default=20)
    parser.add_argument(
        "--bucket-mb",
        type=int,
        default=None,
        help="DDP's bucket size; default: raytrain's (one bucket under PowerSGD on gloo)",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "comm_hooks.json"))
    args = parser.parse_args()
    rows = measure(args)
    header = f"{'model':<8}{'hook':<10}{'KB/step':>10}{'vs none':>9}{'step, ms':>10}{'val_acc':>9}"
    print(header)
    print("-" * len(header))
    base = {r["model"]: r for r in rows if r["hook"] == "none"}
    for r in rows:
        ratio = base[r["model"]]["bytes_per_step"] / r["bytes_per_step"]
        acc = f"{r['val_acc']:>9.4f}" if "val_acc" in r else f"{'':>9}"
        print(
            f"{r['model']:<8}{r['hook']:<10}{r['bytes_per_step'] / 1e3:>10.1f}{ratio:>8.1f}x"
            f"{r['step_s'] * 1e3:>10.1f}{acc}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
