"""A data file that passes preflight (its footer reads) but cannot be read in the run ends
with exit 1 and one line naming the file, not a traceback from deep inside pyarrow or Ray
(issue 15, item 12)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.data.sources import read_table
from raytrain.driver.preflight import dataset_schema_names, tensor_type_problem
from raytrain.errors import EXIT_FAILED, TrainingFailed
from raytrain.spec import SourceSpec


def test_a_corrupt_page_names_its_file(tmp_path: Path) -> None:
    table = pa.table({"x": np.arange(1000, dtype=np.float32), "label": np.arange(1000)})
    pq.write_table(table, tmp_path / "a.parquet")
    pq.write_table(table, tmp_path / "b.parquet")
    data = bytearray((tmp_path / "b.parquet").read_bytes())
    data[4:40] = b"\xff" * 36  # the first page header; the footer stays whole
    (tmp_path / "b.parquet").write_bytes(bytes(data))
    assert dataset_schema_names(str(tmp_path), "parquet") == ["x", "label"]  # preflight passes
    with pytest.raises(TrainingFailed) as info:
        read_table(SourceSpec(uri=str(tmp_path)), None)
    assert info.value.exit_code == EXIT_FAILED
    (line,) = info.value.problems
    assert line.startswith(f"data: cannot read {tmp_path / 'b.parquet'} (a file of {tmp_path})")
    assert "\n" not in line


@pytest.mark.parametrize(
    ("arrow_type", "ok"),
    [
        (pa.float32(), True),
        (pa.int64(), True),
        (pa.uint32(), True),
        (pa.bool_(), True),
        (pa.list_(pa.float32()), True),
        (pa.list_(pa.float32(), 64), True),
        (pa.list_(pa.list_(pa.uint8())), False),  # an object array in the batch
        (pa.list_(pa.list_(pa.uint8(), 2), 2), False),
        (pa.dictionary(pa.int32(), pa.int64()), True),
        (pa.string(), False),
        (pa.large_string(), False),
        (pa.binary(), False),
        (pa.timestamp("s"), False),
        (pa.list_(pa.string()), False),
        (pa.struct([("a", pa.int32())]), False),
        (pa.dictionary(pa.int32(), pa.string()), False),
    ],
)
def test_column_types_a_batch_can_hold(arrow_type: pa.DataType, ok: bool) -> None:
    assert (tensor_type_problem(arrow_type) is None) is ok
