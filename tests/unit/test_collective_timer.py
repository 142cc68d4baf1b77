"""``CollectiveTimer`` on two real gloo processes: the seconds a rank spends blocked in a
collective are counted whoever calls it (torch directly, Lightning's ``sync_dist``,
torchmetrics' sync), once per outermost call, and never for an ``async_op`` call."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch.multiprocessing as mp

LATE_S = 0.3  # how late rank 1 comes to each collective


def _metric(metric, x):
    """A metric's value over every rank: ``compute`` syncs its states (torchmetrics'
    ``gather_all_tensors``)."""
    metric.update(x)
    return metric.compute()


def _rank(rank: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torchmetrics
    from lightning.fabric.utilities.distributed import _sync_ddp

    from raytrain._compat.torch_collectives import CollectiveTimer

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    timer, original = CollectiveTimer(), dist.all_reduce
    timer.install()
    assert dist.all_reduce is not original
    calls = {
        "torch": lambda x: dist.all_reduce(x),
        "sync_dist": lambda x: _sync_ddp(x, reduce_op="mean"),  # what self.log(sync_dist) runs
        "torchmetrics": lambda x: _metric(torchmetrics.MeanMetric(), x),
        "nested": lambda x: dist.all_gather_object([None, None], {"rows": 3}),
        "async": lambda x: dist.all_reduce(x, async_op=True).wait(),
    }
    seen = {}
    try:
        for name, call in calls.items():
            dist.barrier()  # both ranks start each case together (itself counted: before)
            before, count = timer.total, timer.calls
            if rank == 1:
                time.sleep(LATE_S)
            call(torch.ones(3))
            seen[name] = [timer.total - before, timer.calls - count]
    finally:
        timer.remove()
    assert dist.all_reduce is original  # torch's own functions are back
    Path(out, f"{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def test_a_rank_waiting_for_a_late_one_is_counted_in_every_collective_path(tmp_path) -> None:
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    fast, slow = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    for name in ("torch", "sync_dist", "torchmetrics", "nested"):
        assert fast[name][0] >= 0.8 * LATE_S, (name, fast)  # rank 0 waited for rank 1
        assert slow[name][0] < 0.5 * LATE_S, (name, slow)  # rank 1 did not wait
    assert fast["nested"][1] == 1  # all_gather_object runs all_gather inside: one call
    assert fast["async"] == [0.0, 0] and slow["async"] == [0.0, 0]  # waited on elsewhere
