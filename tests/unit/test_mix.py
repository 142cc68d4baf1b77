"""Mixed train sets: ``quotas``' shares, ``MixedStream`` over a cached and a streamed
source (real Parquet files), its rows per epoch, its restores on other world sizes, and
the rows it says each source gave."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from raytrain.contract import CachedSet, MixedSet
from raytrain.data.mix import CachedRows, MixedStream, StreamedRows, quotas
from raytrain.data.parquet_stream import WindowReader, row_groups

BIG, SMALL = 230, 41  # rows of the two sources: ids 0.. and 1000..


@pytest.mark.parametrize(
    ("weights", "total"), [([0.8, 0.2], 271), ([1, 1, 1], 100), ([0.5, 0.3, 0.2], 7), ([3], 5)]
)
def test_quotas_sum_to_the_total_each_within_a_row_of_its_share(weights, total) -> None:
    got = quotas(weights, total)
    assert sum(got) == total
    assert all(abs(q - w / sum(weights) * total) < 1 for q, w in zip(got, weights, strict=True))


@pytest.mark.parametrize(
    ("weights", "total"), [([1e308, 1e308], 2874), ([1e308, 1e307], 11), ([5e-324, 5e-324], 9)]
)
def test_quotas_hold_their_invariant_at_the_ends_of_the_floats(weights, total) -> None:
    """Weights whose sum overflows once gave [1, 1] for a 2,874-row epoch: scaled by the
    largest first, they split it exactly."""
    got = quotas(weights, total)
    assert sum(got) == total
    assert all(
        abs(q - w / max(weights) / sum(x / max(weights) for x in weights) * total) < 1
        for q, w in zip(got, weights, strict=True)
    )


@pytest.mark.parametrize("weights", [[], [float("inf"), 1.0], [float("nan")], [0.0, 1.0]])
def test_quotas_refuse_weights_they_cannot_split_by(weights) -> None:
    with pytest.raises(ValueError, match="finite and positive"):
        quotas(weights, 10)


def _mix(tmp_path: Path, world: int, rank: int, epoch_rows: int | None = None) -> MixedStream:
    folder = tmp_path / "big"
    if not folder.exists():
        folder.mkdir()
        pq.write_table(
            pa.table({"id": pa.array(range(BIG), pa.int64())}),
            folder / "part-0.parquet",
            row_group_size=30,
        )
    small = pa.table({"id": pa.array(range(1000, 1000 + SMALL), pa.int64())})
    found = row_groups(str(folder), pafs.LocalFileSystem(), str(folder))
    mix = MixedSet(
        names=("big", "small"),
        weights=(0.8, 0.2),
        parts=(found, CachedSet([], SMALL)),
        rows=(BIG, SMALL),
        epoch_rows=epoch_rows or BIG + SMALL,
    )
    sources = [
        StreamedRows(WindowReader(found, pafs.LocalFileSystem(), ["id"]), 11, 64),
        CachedRows(small, 12),
    ]
    return MixedStream(mix, sources, 8, rank=rank, world_size=world, shuffle_seed=3)


def _epoch(streams: list[MixedStream], epoch: int) -> list[int]:
    for s in streams:
        s.epoch = epoch
    return [i for s in streams for batch in s for i in batch["id"].tolist()]


def test_each_epoch_draws_the_quotas_and_a_small_source_starts_over_in_a_new_order(
    tmp_path: Path,
) -> None:
    streams = [_mix(tmp_path, 2, r) for r in (0, 1)]
    assert len({len(s) for s in streams}) == 1
    epochs = [_epoch(streams, e) for e in range(3)]
    big_q, small_q = streams[0].quotas  # 0.8 and 0.2 of 271 rows
    assert (big_q, small_q) == (217, 54)
    for rows in epochs:
        assert len(rows) == BIG + SMALL
        assert sum(i < 1000 for i in rows) == big_q and sum(i >= 1000 for i in rows) == small_q
    # each source's sequence goes on across epochs: the big one's 230 rows each once in
    # its first 230 draws; the small one's 41 rows each once per pass (54 draws an epoch)
    big = [i for rows in epochs for i in rows if i < 1000]
    small = [i for rows in epochs for i in rows if i >= 1000]
    assert sorted(big[:BIG]) == list(range(BIG))
    assert sorted(small[:SMALL]) == list(range(1000, 1000 + SMALL))
    assert sorted(small[SMALL : 2 * SMALL]) == list(range(1000, 1000 + SMALL))
    assert small[:SMALL] != small[SMALL : 2 * SMALL]  # a new order each pass
    assert epochs[0] != epochs[1]


@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 1), (1, 3)])
def test_a_restored_mix_trains_exactly_the_rows_an_uninterrupted_one_does(
    tmp_path: Path, before: int, after: int
) -> None:
    whole = Counter(_epoch([_mix(tmp_path, 2, r) for r in (0, 1)], 1))
    streams = [_mix(tmp_path, before, r) for r in range(before)]
    for s in streams:
        s.epoch = 1
    batches = [[b["id"].tolist() for b in s] for s in streams]
    done = 5
    trained = [i for rank in batches for b in rank[:done] for i in b]
    for s in streams:
        s.position = done
    state = streams[0].state_dict()
    seen_then = streams[0].rows_seen()
    resumed = [_mix(tmp_path, after, r) for r in range(after)]
    for s in resumed:
        s.load_state_dict(state)
    assert resumed[0].rows_seen() == seen_then
    rest = [i for s in resumed for b in s for i in b["id"].tolist()]
    assert Counter(trained + rest) == whole  # the same rows, each as often
    # the counts: epoch 0's quotas plus what was trained of epoch 1 at the save
    big_q, small_q = streams[0].quotas
    assert seen_then == {
        "big": big_q + sum(i < 1000 for i in trained),
        "small": small_q + sum(i >= 1000 for i in trained),
    }
    for s in resumed:
        s.position = len(s)
    assert resumed[0].rows_seen() == {"big": 2 * big_q, "small": 2 * small_q}


def test_a_fixed_epoch_of_rows_draws_by_weight(tmp_path: Path) -> None:
    streams = [_mix(tmp_path, 2, r, epoch_rows=100) for r in (0, 1)]
    rows = _epoch(streams, 0)
    assert len(rows) == 100 and sum(i >= 1000 for i in rows) == 20


def _mix_spec(tmp_path: Path, sources: list[dict]) -> dict:
    from tests.conftest import digits_spec

    spec = digits_spec(tmp_path, tmp_path)
    spec["data"] |= {"train": sources, "columns": None}
    spec["data"].pop("val", None)
    return spec


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ({"uri": "/d/a", "weight": float("inf")}, "data.train.0.weight: "),
        (
            {"uri": "/d/part=1", "weight": 1.0},
            "data.train.0.uri: its end names the source's "
            "metrics while `name` is unset: 'part=1' cannot name",
        ),
        (
            {"uri": "/d/..", "weight": 1.0},
            "data.train.0.uri: its end names the source's "
            "metrics while `name` is unset: '..' cannot name",
        ),
        ({"uri": "/d/.hidden/", "weight": 1.0}, "data.train.0.uri: its end names"),
        (
            {"uri": "/d/a", "weight": 1.0, "name": ".."},
            "data.train.0.name: '..' cannot name files, metrics or labels",
        ),
        ({"uri": "/d/a", "weight": 1.0, "name": "."}, "data.train.0.name: '.' "),
        ({"uri": "/d/a", "weight": 1.0, "name": "a/../b"}, "data.train.0.name:"),
        ({"uri": "/d/a", "weight": 1.0, "format": "csv"}, "a mix reads Parquet sources only"),
    ],
)
def test_a_bad_mix_source_is_named(tmp_path: Path, source: dict, says: str) -> None:
    """A source's name becomes the metric key ``data/rows/NAME``: ``..`` once made MLflow
    refuse every metric batch of the run."""
    from raytrain.errors import SpecError
    from raytrain.spec import parse_spec

    with pytest.raises(SpecError) as caught:
        parse_spec(_mix_spec(tmp_path, [source]))
    (line,) = caught.value.problems
    assert line.startswith(says) or says in line, line


def test_a_uri_ending_in_dots_may_run_under_a_name(tmp_path: Path) -> None:
    from raytrain.spec import parse_spec

    spec = parse_spec(_mix_spec(tmp_path, [{"uri": "/d/..", "weight": 1.0, "name": "up"}]))
    assert spec.files is not None and spec.files.train[0].label() == "up"  # type: ignore[index]


@pytest.mark.parametrize(
    ("weights", "epoch_rows", "says"),
    [
        (
            [1e308, 1e308],
            None,
            "data.train.1.weight: the sources' weights sum past the largest float",
        ),
        (
            [1.0, 1.0],
            10**15,
            "data.epoch_rows: 1000000000000000 rows: every rank "
            "would hold 9.31e+05 GiB of the epoch's labels",
        ),
        ([1.0] * 300, 2**29, "data.epoch_rows: 536870912 rows: every rank would hold 2 GiB"),
    ],
)
def test_weights_and_epochs_past_their_bounds_are_refused(
    tmp_path: Path, weights: list[float], epoch_rows: int | None, says: str
) -> None:
    from raytrain.errors import SpecError
    from raytrain.spec import parse_spec

    spec = _mix_spec(tmp_path, [{"uri": f"/d/s{j}", "weight": w} for j, w in enumerate(weights)])
    spec["data"]["epoch_rows"] = epoch_rows
    with pytest.raises(SpecError) as caught:
        parse_spec(spec)
    (line,) = caught.value.problems
    assert line.startswith(says), line
    spec["data"]["epoch_rows"] = 2**30 if len(weights) <= 256 else 2**28  # the limit: fine
    spec["data"]["train"] = [{"uri": f"/d/s{j}", "weight": 1.0} for j in range(len(weights))]
    parse_spec(spec)


def test_sources_whose_columns_differ_are_refused_before_the_run(tmp_path: Path) -> None:
    from raytrain.driver.preflight import check_data
    from raytrain.spec import parse_spec

    for name, label in (("a", pa.int64()), ("b", pa.int32())):
        (tmp_path / name).mkdir()
        pq.write_table(
            pa.table({"id": pa.array([1, 2], pa.int64()), "label": pa.array([0, 1], label)}),
            tmp_path / name / "part-0.parquet",
        )
    sources = [{"uri": str(tmp_path / n), "weight": 1.0} for n in ("a", "b")]
    (problem,) = check_data(parse_spec(_mix_spec(tmp_path, sources)))
    assert problem == (
        "data.train.1.uri: its columns differ from data.train.0's: label int32 against label int64"
    )
    sources[1]["uri"] = str(tmp_path / "a")
    sources[1]["name"] = "a2"
    assert check_data(parse_spec(_mix_spec(tmp_path, sources))) == []
