"""The baseline: a hand-written torch DDP loop over the same data and model as raytrain.

torch.multiprocessing starts one process per worker; gloo; a DistributedSampler with the same
seed each epoch; the same per-worker batch; one thread per worker; validation and a rank-0
checkpoint (model + optimizer) every epoch, as raytrain does by default.

    python bench/ddp_baseline.py --model digits --epochs 4 --data DIR --out timing.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _load(path: str):
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    table = pq.read_table(path, columns=["pixels", "label"])
    pixels = np.stack(table.column("pixels").to_numpy(zero_copy_only=False)).astype("float32")
    labels = table.column("label").to_numpy().copy()
    return torch.utils.data.TensorDataset(torch.from_numpy(pixels), torch.from_numpy(labels))


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from bench.timed import MODELS, StepClock
    from raytrain.models.digits import DigitsCNN

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=args.workers, timeout=datetime.timedelta(seconds=60)
    )
    torch.manual_seed(42)
    config = MODELS[args.model]
    module = DigitsCNN(**config["init_args"])
    model = DDP(module, gradient_as_bucket_view=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=config["init_args"]["lr"])
    train, val = _load(os.path.join(args.data, "train")), _load(os.path.join(args.data, "val"))
    sampler = DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    val_sampler = DistributedSampler(val, shuffle=False)
    loader = DataLoader(train, batch_size=config["batch_size"], sampler=sampler)
    val_loader = DataLoader(val, batch_size=config["batch_size"], sampler=val_sampler)
    clock = StepClock()
    ckpt_dir = tempfile.mkdtemp(prefix="ddp-baseline-")
    for epoch in range(args.epochs):
        clock.epoch_start()
        sampler.set_epoch(epoch)
        model.train()
        for pixels, labels in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(pixels), labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            clock.step_end()
        model.eval()
        correct = torch.zeros(2)
        with torch.no_grad():
            for pixels, labels in val_loader:
                correct += torch.tensor(
                    [(module(pixels).argmax(1) == labels).sum().item(), len(labels)]
                )
        dist.all_reduce(correct)
        if rank == 0:
            torch.save(
                {"model": module.state_dict(), "optimizer": optimizer.state_dict()},
                os.path.join(ckpt_dir, f"epoch{epoch}.pt"),
            )
        dist.barrier()
    clock.end()
    if rank == 0:
        clock.dump(args.out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="digits")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(args, free_port()), nprocs=args.workers, join=True)


if __name__ == "__main__":
    main()
