"""Real text that every machine with Python has: the standard library's own source files.

No download. ``write_splits`` is the tinygpt job's ``data.prepare`` step: the top-level
``*.py`` files of the running interpreter's standard library, in name order, up to
``MAX_BYTES``, cut into rows of ``BLOCK + 1`` consecutive bytes (a model reads ``BLOCK``
bytes and predicts each next one). Files are split between train and val whole, every
``VAL_EVERY``-th file to val, so no val text is in train.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain import storage

BLOCK = 128
MAX_BYTES = 3 * 2**20
VAL_EVERY = 10


def stdlib_files() -> list[str]:
    """The standard library's top-level source files, sorted by name."""
    root = sysconfig.get_paths()["stdlib"]
    return sorted(os.path.join(root, name) for name in os.listdir(root) if name.endswith(".py"))


def rows_of(data: bytes, block: int = BLOCK) -> pa.Table:
    """``data`` as rows of ``block + 1`` bytes (``tokens``: uint8), the tail dropped."""
    width = block + 1
    n = len(data) // width
    flat = np.frombuffer(data[: n * width], dtype=np.uint8)
    return pa.table(
        {
            "id": pa.array(np.arange(n), pa.int64()),
            "tokens": pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.uint8()), width),
        }
    )


def write_splits(train_uri: str, val_uri: str | None, max_bytes: int = MAX_BYTES) -> None:
    """Write the train and val splits (one Parquet file each) of the stdlib corpus."""
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    total = 0
    for i, path in enumerate(stdlib_files()):
        with open(path, "rb") as handle:
            text = handle.read()
        parts["val" if i % VAL_EVERY == VAL_EVERY - 1 else "train"].append(text)
        total += len(text)
        if total >= max_bytes and parts["val"]:  # a small corpus still gets a val file
            break
    for name, uri in (("train", train_uri), ("val", val_uri)):
        if uri is None:
            continue
        fs, path = storage.filesystem(uri)
        fs.create_dir(path)
        table = rows_of(b"".join(parts[name]))
        pq.write_table(table, f"{path}/part-0.parquet", filesystem=fs)
