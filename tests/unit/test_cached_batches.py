"""The cached-set loader: every row once per epoch, equal step counts, a global reshuffle."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from raytrain.data.loaders import CachedBatches
from raytrain.data.order import step_slices

ROWS = 103


def _table() -> pa.Table:
    return pa.table(
        {
            "id": pa.array(np.arange(ROWS), pa.int64()),
            "x": pa.array(np.arange(ROWS) * 0.5, pa.float32()),
        }
    )


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
def test_every_row_once_per_epoch_and_equal_step_counts(world: int) -> None:
    for epoch in range(3):
        shards = _epoch_ids(world, epoch=epoch)
        seen = sorted(i for s in shards for i in s)
        assert seen == list(range(ROWS))  # no row dropped, none twice
    counts = {len(CachedBatches(_table(), 8, rank=r, world_size=world)) for r in range(world)}
    assert len(counts) == 1


@pytest.mark.parametrize(
    ("rows", "batch", "world"),
    [(103, 8, 2), (6 * 32 + 1, 16, 2), (100, 10, 4), (7, 8, 3), (3, 1, 3), (65, 32, 2)],
)
def test_step_slices_cover_each_row_once_with_no_empty_batch(
    rows: int, batch: int, world: int
) -> None:
    steps = step_slices(rows, batch, world)
    covered = [i for step in steps for lo, hi in step for i in range(lo, hi)]
    assert covered == list(range(rows))
    assert all(len(step) == world for step in steps)
    sizes = [hi - lo for step in steps for lo, hi in step]
    assert min(sizes) >= 1
    assert max(sizes) <= batch + 1  # a remainder smaller than the world joins the step before


def test_fewer_rows_than_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="2 rows cannot give each of 3 workers"):
        step_slices(2, 8, 3)


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
    shards = _epoch_ids(2, epoch=5, seed=None, batch=8)
    # steps of 16 rows, 8 to each rank, in file order; the last 7 rows split 3/4
    assert shards[0][:16] == list(range(8)) + list(range(16, 24))
    assert shards[1][:8] == list(range(8, 16))
    assert shards[0][-3:] == [96, 97, 98] and shards[1][-4:] == [99, 100, 101, 102]


def _trained_before(world: int, steps: int, epoch: int, seed: int = 0) -> tuple[list[int], dict]:
    """The ids the first ``steps`` steps of ``epoch`` trained (all ranks), and the state
    rank 0's loader would save in a checkpoint taken then."""
    ids, state = [], {}
    for rank in range(world):
        loader = CachedBatches(_table(), 8, rank=rank, world_size=world, shuffle_seed=seed)
        loader.epoch = epoch
        for position, batch in enumerate(loader, start=1):
            if position > steps:
                break
            loader.position = position  # as LoaderPosition sets it when a batch begins
            ids.extend(int(i) for i in batch["id"])
        if rank == 0:
            state = loader.state_dict()
    return ids, state


@pytest.mark.parametrize(("world", "new_world"), [(2, 2), (2, 1), (2, 3), (3, 2)])
@pytest.mark.parametrize("steps", [1, 3])
def test_a_mid_epoch_restore_trains_the_rest_of_the_epoch_once(
    world: int, new_world: int, steps: int
) -> None:
    """Restored mid-epoch, even on another number of workers: the steps before the
    checkpoint and the steps after it cover every row of the epoch exactly once."""
    before, state = _trained_before(world, steps, epoch=1)
    assert state == {"epoch": 1, "steps": steps, "rows": len(before)}
    after, lengths = [], set()
    for rank in range(new_world):
        loader = CachedBatches(_table(), 8, rank=rank, world_size=new_world, shuffle_seed=0)
        loader.load_state_dict(state)
        lengths.add(len(loader))  # what Lightning reads: steps done plus steps left
        batches = list(loader)
        after.extend(int(i) for b in batches for i in b["id"])
        assert steps + len(batches) == len(loader)
    assert len(lengths) == 1  # every rank the same number of steps
    assert sorted(before + after) == list(range(ROWS))
    # the next epoch is whole again, with the new world's length
    loader = CachedBatches(_table(), 8, rank=0, world_size=new_world, shuffle_seed=0)
    loader.load_state_dict(state)
    list(loader)
    loader.epoch = 2
    assert len(loader) == len(step_slices(ROWS, 8, new_world))


def test_a_restore_at_an_epoch_end_starts_the_next_epoch_whole() -> None:
    whole = len(CachedBatches(_table(), 8, rank=0, world_size=2))
    _, state = _trained_before(2, whole, epoch=0)
    assert state["rows"] == ROWS
    loader = CachedBatches(_table(), 8, rank=0, world_size=2, shuffle_seed=0)
    loader.load_state_dict(state)
    loader.epoch = 1  # Lightning starts the next epoch
    assert len(list(loader)) == whole
