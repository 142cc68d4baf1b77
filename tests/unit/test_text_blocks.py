"""CSV and JSON Lines read by each rank (``text_blocks`` through ``ParquetStream``): files
split into blocks on lines' ends and parsed once on the driver, every row once per epoch,
restores on other world sizes that train exactly the rows left, and files named when they
do not parse."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raytrain.data import text_blocks
from raytrain.data.parquet_stream import ParquetStream
from raytrain.data.text_blocks import BadRows, plan_text

ROWS = 301
SPANS = [(0, 100), (100, 133), (133, ROWS)]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of about 400 bytes: each file is several, so blocks end mid-file."""
    monkeypatch.setattr(text_blocks, "BLOCK_BYTES", 400)
    text_blocks._MEMO.clear()


def write(folder: Path, fmt: str) -> Path:
    """ROWS rows (``id``, ``x``: a float, written as an int where it is whole, so the
    first blocks' parse says int64) in 3 files."""
    folder.mkdir()
    for n, (lo, hi) in enumerate(SPANS):
        values = [(i, i if i < 200 else i + 0.5) for i in range(lo, hi)]
        if fmt == "csv":
            text = "id,x\n" + "".join(f"{i},{x}\n" for i, x in values)
        else:
            text = "".join(json.dumps({"id": i, "x": x}) + "\n" for i, x in values)
        (folder / f"part-{n}.{fmt}").write_text(text)
    return folder


def streams(folder: Path, fmt: str, world: int, **kwargs) -> list[ParquetStream]:
    fs = pafs.LocalFileSystem()
    found = plan_text(str(folder), fs, str(folder), fmt)
    return [
        ParquetStream(found, fs, ["id", "x"], 16, rank=r, world_size=world, **kwargs)
        for r in range(world)
    ]


def ids(stream: ParquetStream) -> list[list[int]]:
    return [batch["id"].tolist() for batch in stream]


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_blocks_end_on_lines_and_count_every_row_with_one_schema(tmp_path: Path, fmt: str) -> None:
    found = plan_text("x", pafs.LocalFileSystem(), str(write(tmp_path / "t", fmt)), fmt)
    assert found.num_rows == ROWS and len(found.files) == 3
    assert len(found.blocks) > 6  # several blocks a file
    assert str(found.schema.field("x").type) == "float"  # int64 in the first blocks: float32
    for j, path in enumerate(found.files):
        data = Path(path).read_bytes()
        mine = [found.blocks[u] for f, u, _ in found.row_groups if f == j]
        assert all(data[at + length - 1 : at + length] == b"\n" for at, length in mine)
        first = data.index(b"\n") + 1 if fmt == "csv" else 0
        assert mine[0][0] == first and sum(n for _, n in mine) == len(data) - first


@pytest.mark.parametrize("fmt", ["csv", "json"])
@pytest.mark.parametrize(("before", "after"), [(2, 1), (3, 2)])
def test_every_row_once_per_epoch_and_exact_on_a_restore_at_another_world_size(
    tmp_path: Path, fmt: str, before: int, after: int
) -> None:
    folder = write(tmp_path / "t", fmt)
    first = streams(folder, fmt, before, shuffle_seed=5, window_rows=50)
    whole = [i for s in first for batch in ids(s) for i in batch]
    assert sorted(whole) == list(range(ROWS)) and whole != list(range(ROWS))
    for s in first:
        s.epoch = 1
    batches = [ids(s) for s in first]
    assert len({len(b) for b in batches}) == 1
    done = 3
    trained = [i for rank in batches for batch in rank[:done] for i in batch]
    for s in first:
        s.position = done
    state = first[0].state_dict()
    resumed = streams(folder, fmt, after, shuffle_seed=5, window_rows=50)
    for s in resumed:
        s.load_state_dict(state)
    left = [i for s in resumed for batch in ids(s) for i in batch]
    assert sorted(trained + left) == list(range(ROWS))


def test_a_csv_row_with_the_wrong_field_count_is_named_with_its_file(tmp_path: Path) -> None:
    folder = write(tmp_path / "t", "csv")
    bad = folder / "part-1.csv"
    bad.write_text(bad.read_text().replace("\n120,120\n", "\n120,120,7\n"))
    with pytest.raises(
        BadRows,
        match=r"part-1\.csv, line 22: CSV parse error: "
        r"Expected 2 columns, got 3: 120,120,7",
    ):
        plan_text("t", pafs.LocalFileSystem(), str(folder), "csv")


def test_csv_files_whose_headers_differ_are_named(tmp_path: Path) -> None:
    folder = write(tmp_path / "t", "csv")
    (folder / "part-2.csv").write_text("id,y\n1,2\n")
    with pytest.raises(BadRows, match=r"part-2\.csv: its header \['id', 'y'\] differs"):
        plan_text("t", pafs.LocalFileSystem(), str(folder), "csv")


def test_a_json_line_that_does_not_parse_is_named(tmp_path: Path) -> None:
    folder = write(tmp_path / "t", "json")
    (folder / "part-0.json").write_text('{"id": 1, "x": 2}\n{"id": 2, "x": \n')
    with pytest.raises(BadRows, match=r"part-0\.json, line 2: JSON parse error: Invalid value\.$"):
        plan_text("t", pafs.LocalFileSystem(), str(folder), "json")


def test_files_with_no_rows_are_said_so_and_a_readme_beside_the_csv_is_not_read(
    tmp_path: Path,
) -> None:
    folder = write(tmp_path / "t", "csv")
    (folder / "README.md").write_text("# not,a,csv\nat all\n")
    assert plan_text("t", pafs.LocalFileSystem(), str(folder), "csv").num_rows == ROWS
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "only-header.csv").write_text("id,x\n")
    with pytest.raises(BadRows, match=r"no rows in the csv files under e"):
        plan_text("e", pafs.LocalFileSystem(), str(tmp_path / "empty"), "csv")
