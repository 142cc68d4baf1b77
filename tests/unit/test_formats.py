"""CSV and newline-delimited JSON splits: read with the spec's projection, and checked by
preflight for the columns it names, like Parquet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain.data import sources as data
from raytrain.driver import preflight
from raytrain.spec import SourceSpec, parse_spec
from tests.conftest import digits_spec


def write(folder: Path, fmt: str) -> None:
    folder.mkdir(parents=True)
    rows = [{"x": float(i), "y": i % 3, "note": f"row {i}"} for i in range(10)]
    for part in (0, 1):  # a folder of several files
        chunk = rows[part * 5 : part * 5 + 5]
        if fmt == "csv":
            lines = ["x,y,note"] + [f"{r['x']},{r['y']},{r['note']}" for r in chunk]
        else:
            lines = [json.dumps(r) for r in chunk]
        (folder / f"part-{part}.{fmt}").write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_projection_reads_only_the_named_columns(fmt: str, tmp_path: Path) -> None:
    write(tmp_path / fmt, fmt)
    table = data.read_table(SourceSpec(uri=str(tmp_path / fmt), format=fmt), ["x", "y"])
    assert table.column_names == ["x", "y"]
    assert sorted(table.column("y").to_pylist()) == sorted(i % 3 for i in range(10))


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_preflight_names_a_missing_column(fmt: str, tmp_path: Path) -> None:
    write(tmp_path / fmt, fmt)
    spec = digits_spec(tmp_path, tmp_path)
    spec["data"] = {"train": {"uri": str(tmp_path / fmt), "format": fmt}, "columns": ["x", "z"]}
    problems = preflight.check_data(parse_spec(spec))
    assert problems == [f"data.columns: 'z' not in data.train ({tmp_path / fmt} has: x, y, note)"]
