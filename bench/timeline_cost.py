"""What the per-rank step timeline costs a compute-bound DDP step, measured so that this
machine's drift cancels out.

End to end, runs of bench/overhead.py's compute-bound model spread from 113 to 158 ms a
step between runs of the same configuration on this 2-core shared machine, so a 2% cost
cannot show there. Here two gloo processes train bench/overhead.py's compute model (the
digits CNN with 96 channels and 512 hidden units, batch 128, Adam) under
DistributedDataParallel, and alternate blocks of steps timeline off and on within the
same processes. "On" runs everything the timeline adds to a step: its DDP communication
hook (a fresh DDP wrapper per block, since DDP takes one hook once) and its hooks at each
of Lightning's marks, with a window's summary sent every 10 steps. The figure is the
median of the on/off ratios of adjacent blocks.

    python bench/timeline_cost.py [--blocks 8] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _block(rank: int, on: bool, steps: int, x: Any, y: Any) -> float:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from raytrain.models.digits import DigitsCNN
    from raytrain.worker.comm_hooks import HookState, gradient_hook
    from raytrain.worker.step_timeline import StepTimeline

    torch.manual_seed(0)
    ddp = DistributedDataParallel(DigitsCNN(lr=0.001, channels=96, hidden=512))
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.001)
    sent: list[dict] = []
    timeline = StepTimeline(every_n_steps=10, publish=sent.append, rank=rank, node="bench")
    trainer = SimpleNamespace(global_step=0, world_size=2)
    if on:
        ddp.register_comm_hook(HookState(timeline=timeline), gradient_hook)
        timeline.comm_measured = True
        timeline.on_train_epoch_start(trainer, None)  # type: ignore[arg-type]
    end = timeline.end_marker()
    warm = 3
    for step in range(warm + steps):
        if step == warm:
            started = time.perf_counter()
        if on:
            timeline.on_train_batch_start(trainer, None, None, step)  # type: ignore[arg-type]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        if on:
            timeline.on_before_backward(trainer, None, loss)  # type: ignore[arg-type]
        loss.backward()
        if on:
            timeline.on_after_backward(trainer, None)  # type: ignore[arg-type]
            timeline.on_before_optimizer_step(trainer, None, optimizer)  # type: ignore[arg-type]
        optimizer.step()
        trainer.global_step += 1
        if on:
            timeline.on_train_batch_end(trainer, None, None, None, step)  # type: ignore[arg-type]
            end.on_train_batch_end(trainer, None, None, None, step)  # type: ignore[arg-type]
    elapsed = (time.perf_counter() - started) / steps
    assert not on or sent, "the timeline sent no window"
    return elapsed


def _worker(rank: int, blocks: int, steps: int, port: int, out: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    generator = torch.Generator().manual_seed(rank)
    x = torch.rand(128, 64, generator=generator) * 16  # pixels 0-16, as the digits
    y = torch.randint(0, 10, (128,), generator=generator)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for block in range(blocks):
        order = ("off", "on") if block % 2 == 0 else ("on", "off")
        for side in order:
            times[side].append(_block(rank, side == "on", steps, x, y))
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(times))


def measure(blocks: int = 8, steps: int = 20) -> dict[str, Any]:
    """Step times of ``blocks`` adjacent off/on pairs in two gloo processes, and the
    median of their on/off ratios (``ratio``)."""
    import json
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        mp.spawn(_worker, args=(blocks, steps, port, out), nprocs=2)
        times = json.loads(Path(out).read_text())
    ratios = [on / off for on, off in zip(times["on"], times["off"], strict=True)]
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {**times, "ratios": ratios, "ratio": statistics.median(ratios), "off_s": off, "on_s": on}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    found = measure(args.blocks, args.steps)
    print(f"step, timeline off (ms): {[round(t * 1000, 1) for t in found['off']]}")
    print(f"step, timeline on  (ms): {[round(t * 1000, 1) for t in found['on']]}")
    print(f"on / off, adjacent blocks: {[round(r, 3) for r in found['ratios']]}")
    print(
        f"median: {found['ratio']:.3f} (off {found['off_s'] * 1000:.1f} ms, "
        f"on {found['on_s'] * 1000:.1f} ms a step)"
    )


if __name__ == "__main__":
    main()
