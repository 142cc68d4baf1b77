"""Streamed Parquet splits read by each rank: ``data.order``'s blocks and
``ParquetStream``'s batches over real files, every row once per epoch, and restores on
other world sizes that train exactly the rows left."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from raytrain.data.order import StreamSchedule, rank_block, span
from raytrain.data.parquet_stream import EpochLayout, ParquetStream, row_groups

ROWS = 301  # odd, and not a multiple of any batch or row group size below


def _files(tmp_path: Path) -> Path:
    """ROWS rows with an ``id`` column in 3 files of row groups of 40 rows or fewer."""
    folder = tmp_path / "train"
    folder.mkdir()
    for i, (lo, hi) in enumerate([(0, 100), (100, 133), (133, ROWS)]):
        table = pa.table(
            {
                "id": pa.array(range(lo, hi), pa.int64()),
                "x": pa.array([float(v) for v in range(lo, hi)]),
            }
        )
        pq.write_table(table, folder / f"part-{i}.parquet", row_group_size=40)
    return folder


def _streams(folder: Path, world: int, **kwargs) -> list[ParquetStream]:
    found = row_groups(str(folder), pafs.LocalFileSystem(), str(folder))
    return [
        ParquetStream(found, pafs.LocalFileSystem(), ["id"], 16, rank=r, world_size=world, **kwargs)
        for r in range(world)
    ]


def _ids(batches) -> list[list[int]]:
    return [batch["id"].tolist() for batch in batches]


def test_the_footers_give_every_row_group_in_file_order(tmp_path: Path) -> None:
    found = row_groups("x", pafs.LocalFileSystem(), str(_files(tmp_path)))
    assert found.num_rows == ROWS and len(found.files) == 3
    assert [n for f, _, n in found.row_groups if f == 0] == [40, 40, 20]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("seed", [None, 5])
def test_every_row_once_per_epoch_equal_steps_none_empty(
    tmp_path: Path, world: int, seed: int | None
) -> None:
    streams = _streams(_files(tmp_path), world, shuffle_seed=seed, window_rows=64)
    orders = []
    for epoch in (0, 1):
        for s in streams:
            s.epoch = epoch
        per_rank = [_ids(s) for s in streams]
        assert len({len(b) for b in per_rank}) == 1 == len({len(s) for s in streams})
        assert len(per_rank[0]) == len(streams[0])
        assert all(len(batch) >= 1 for batches in per_rank for batch in batches)
        rows = [i for batches in per_rank for batch in batches for i in batch]
        assert sorted(rows) == list(range(ROWS))
        orders.append(rows)
    # a seeded shuffle reorders every epoch; without a seed the files' order stays
    assert (orders[0] != orders[1]) == (seed is not None)
    assert (orders[0] == list(range(ROWS))) == (seed is None)


@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 1), (1, 3), (3, 2)])
def test_a_restore_mid_epoch_on_any_world_size_trains_exactly_the_rows_left(
    tmp_path: Path, before: int, after: int
) -> None:
    folder = _files(tmp_path)
    streams = _streams(folder, before, shuffle_seed=3, window_rows=64)
    for s in streams:
        s.epoch = 1
    batches = [_ids(s) for s in streams]
    done = 4  # steps trained before the "kill"
    trained = [i for rank in batches for batch in rank[:done] for i in batch]
    for s in streams:
        s.position = done
    state = streams[0].state_dict()
    assert all(s.state_dict() == state for s in streams)  # every rank saves the same

    resumed = _streams(folder, after, shuffle_seed=3, window_rows=64)
    for s in resumed:
        s.load_state_dict(state)
    rest = [_ids(s) for s in resumed]
    assert len({len(r) for r in rest}) == 1 and all(len(s) == done + len(rest[0]) for s in resumed)
    left = [i for rank in rest for batch in rank for i in batch]
    assert sorted(trained + left) == list(range(ROWS))  # none twice, none skipped
    for s in resumed:  # the next epoch is whole again
        s.epoch = 2
    assert sorted(i for s in resumed for batch in _ids(s) for i in batch) == list(range(ROWS))


def test_schedules_cut_any_chain_of_restores_into_each_row_once() -> None:
    """``StreamSchedule``'s invariant over random chains of restores at random world sizes
    and stopping points: every rank the same number of steps, none empty, and each row
    trained once. (A restore that leaves fewer rows than workers skips them, warned, as
    ``EpochSchedule`` does: those chains are only checked for repeats.)"""
    rng = random.Random(0)
    whole = 0
    for _ in range(1000):
        n, batch = rng.randint(4, 150), rng.randint(1, 9)
        worlds = [rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        if n < worlds[0]:
            continue
        seen: list[int] = []
        state: dict | None = None
        skipped = False
        for k, world in enumerate(worlds):
            schedules = [StreamSchedule(n, batch, rank=r, world_size=world) for r in range(world)]
            if state is not None:
                skipped |= 0 < span([tuple(i) for i in state["left"]]) < world
                for s in schedules:
                    s.load_state_dict(state)
            plans = [s.plan() for s in schedules]
            steps, done = len(plans[0][2]), plans[0][0]
            assert {len(p[2]) for p in plans} == {steps} and all(
                min(p[2], default=1) for p in plans
            )
            assert all(len(s) == done + steps for s in schedules)
            stop = steps if k == len(worlds) - 1 else rng.randint(0, steps)
            for _, block, sizes in plans:
                seen += [i for lo, hi in block for i in range(lo, hi)][: sum(sizes[:stop])]
            for s in schedules:
                s.position = done + stop
            state = schedules[0].state_dict()
            assert all(s.state_dict() == state for s in schedules)
        assert len(seen) == len(set(seen))
        if not skipped:
            assert sorted(seen) == list(range(n)), (n, batch, worlds)
            whole += 1
    assert whole > 900


def test_blocks_are_consecutive_and_whole() -> None:
    left = [(0, 10), (20, 35), (50, 51)]
    blocks = [rank_block(left, 4, 3, r) for r in range(3)]
    flat = [i for block, _ in blocks for lo, hi in block for i in range(lo, hi)]
    assert flat == [i for lo, hi in left for i in range(lo, hi)]
    assert len({len(sizes) for _, sizes in blocks}) == 1


def test_windows_hold_at_least_their_rows_and_positions_map_into_them() -> None:
    layout = EpochLayout([5, 3, 7, 2], seed=1, epoch=0, window_rows=6)
    assert sorted(g for w in layout.windows for g in w) == [0, 1, 2, 3]
    assert all(sum([5, 3, 7, 2][g] for g in w) >= 6 for w in layout.windows[:-1])
    sizes = [b - a for a, b in itertools.pairwise(layout.starts)]
    assert list(layout.pieces([(0, 17)])) == [(w, 0, n) for w, n in enumerate(sizes)]


def test_a_position_saved_by_the_other_path_resumes_exact_in_count(tmp_path: Path) -> None:
    """A split that fits the object store on a bigger cluster is cached where it was
    streamed (and the other way): the restore takes the other loader's position as a count
    of rows trained, instead of failing on its keys."""
    import pyarrow.dataset as pads

    from raytrain.data.loaders import CachedBatches

    folder = _files(tmp_path)
    streams = _streams(folder, 2, shuffle_seed=3, window_rows=64)
    for s in streams:
        s.epoch = 1
    done = 3
    for s in streams:
        s.position = done
    streamed_state = streams[0].state_dict()
    table = pads.dataset(str(folder)).to_table(columns=["id"])
    cached = [CachedBatches(table, 16, rank=r, world_size=2, shuffle_seed=3) for r in (0, 1)]
    for c in cached:
        c.load_state_dict(streamed_state)
    rest = sum(len(b["id"]) for c in cached for b in c)
    assert rest == ROWS - done * 2 * 16

    for c in cached:
        c.position = done + 2
    back = _streams(folder, 2, shuffle_seed=3, window_rows=64)
    for s in back:
        s.load_state_dict(cached[0].state_dict())
    assert sum(len(b) for s in back for b in _ids(s)) == ROWS - (done + 2) * 2 * 16


def test_a_ranks_share_in_closed_form_is_step_slices_cut() -> None:
    from raytrain.data.order import rank_share, step_slices

    for total in range(1, 90):
        for batch in (1, 2, 5, 8):
            for world in range(1, min(total, 5) + 1):
                steps = step_slices(total, batch, world)
                start = 0
                for rank in range(world):
                    sizes = [hi - lo for lo, hi in (step[rank] for step in steps)]
                    assert rank_share(total, batch, world, rank) == (start, len(steps), sizes[-1])
                    assert sizes[:-1] == [batch] * (len(steps) - 1)
                    start += sum(sizes)


def double_x(batch: dict) -> dict:
    """A ``data.preprocess``: Ray Data's numpy batch in, a new column out."""
    batch["x2"] = batch["x"] * 2
    return batch


def test_a_preprocess_runs_on_each_batch_and_the_set_stays_exact(tmp_path: Path) -> None:
    found = row_groups("x", pafs.LocalFileSystem(), str(_files(tmp_path)))
    ranks = [
        ParquetStream(
            found,
            pafs.LocalFileSystem(),
            ["id", "x"],
            16,
            rank=r,
            world_size=2,
            shuffle_seed=1,
            window_rows=64,
            preprocess="tests.unit.test_parquet_stream:double_x",
        )
        for r in range(2)
    ]
    batches = [b for s in ranks for b in s]
    assert all((b["x2"] == b["x"] * 2).all() and b["x2"].dtype == b["x"].dtype for b in batches)
    assert sorted(i for b in batches for i in b["id"].tolist()) == list(range(ROWS))
