"""The cached-set loader: disjoint equal shards, a global reshuffle every epoch."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from raytrain.data import CachedBatches

ROWS = 103


def _table() -> pa.Table:
    return pa.table({"id": pa.array(np.arange(ROWS), pa.int64()),
                     "x": pa.array(np.arange(ROWS) * 0.5, pa.float32())})  # fmt: skip


def _epoch_ids(world: int, epoch: int, seed: int | None = 0, batch: int = 8) -> list[list[int]]:
    ids = []
    for rank in range(world):
        loader = CachedBatches(_table(), batch, rank=rank, world_size=world, shuffle_seed=seed)
        loader.epoch = epoch
        batches = list(loader)
        assert len(batches) == len(loader)
        ids.append([int(i) for b in batches for i in b["id"]])
    return ids


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_get_disjoint_equal_shards(world: int) -> None:
    shards = _epoch_ids(world, epoch=0)
    sizes = {len(s) for s in shards}
    assert sizes == {ROWS // world}
    seen = [i for s in shards for i in s]
    assert len(seen) == len(set(seen)) == world * (ROWS // world)


def test_batches_are_tensors_with_the_columns() -> None:
    loader = CachedBatches(_table(), 8, rank=0, world_size=2, shuffle_seed=0)
    batch = next(iter(loader))
    assert set(batch) == {"id", "x"}
    assert batch["x"].shape == (8,)
    assert (batch["x"] * 2).long().tolist() == batch["id"].tolist()  # rows stay whole


def test_order_is_a_function_of_seed_and_epoch() -> None:
    assert _epoch_ids(2, epoch=3) == _epoch_ids(2, epoch=3)
    assert _epoch_ids(2, epoch=3) != _epoch_ids(2, epoch=4)
    assert _epoch_ids(2, epoch=3, seed=1) != _epoch_ids(2, epoch=3, seed=2)
    # the reshuffle is global: a rank's rows change between epochs, not only their order
    assert set(_epoch_ids(2, epoch=0)[0]) != set(_epoch_ids(2, epoch=1)[0])


def test_without_seed_the_order_is_the_file_order() -> None:
    shards = _epoch_ids(2, epoch=5, seed=None)
    assert shards[0] == list(range(ROWS // 2))
    assert shards[1] == list(range(ROWS // 2, 2 * (ROWS // 2)))
