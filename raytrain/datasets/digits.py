"""scikit-learn's bundled digits (1,797 real 8x8 handwritten digits), as Parquet splits.

No download: the images ship inside scikit-learn. ``write_splits`` is the default job's
``data.prepare`` step; it runs once, when the train set is missing.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain import storage

VAL_FRACTION = 0.2
SPLIT_SEED = 0


def digits_table() -> pa.Table:
    """All digits as a table: ``id`` (int64), ``pixels`` (64 x float32, 0..16), ``label``."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pixels = bunch.data.astype(np.float32)
    return pa.table(
        {
            "id": pa.array(np.arange(len(pixels)), pa.int64()),
            "pixels": pa.FixedSizeListArray.from_arrays(pa.array(pixels.ravel()), 64),
            "label": pa.array(bunch.target.astype(np.int64)),
        }
    )


def write_splits(train_uri: str, val_uri: str | None) -> None:
    """Write a stratified-by-shuffle train/val split as one Parquet file per folder."""
    table = digits_table()
    order = np.random.default_rng(SPLIT_SEED).permutation(table.num_rows)
    n_val = round(table.num_rows * VAL_FRACTION)
    parts = {train_uri: order[n_val:], val_uri: order[:n_val]}
    for uri, rows in parts.items():
        if uri is None:
            continue
        fs, path = storage.filesystem(uri)
        fs.create_dir(path)
        pq.write_table(table.take(np.sort(rows)), f"{path}/part-0.parquet", filesystem=fs)
