"""Which path each split takes (``sources.choose_path``): raytrain's own per-rank readers
for every format, Ray Data only where it earns its place (decoding and ``preprocess`` on
the nodes ``data.preprocess_on`` picks), the object store for what fits."""

from __future__ import annotations

import pytest

from raytrain.data.sources import choose_path
from raytrain.spec import DataSpec, SourceSpec

FITS, TOO_BIG, STORE = 1_000, 10**12, 10**9


@pytest.mark.parametrize(
    ("fmt", "fields", "nbytes", "path"),
    [
        ("parquet", {}, FITS, "driver"),
        ("parquet", {}, TOO_BIG, "stream"),
        ("csv", {}, TOO_BIG, "stream"),
        ("json", {"cache": "never"}, FITS, "stream"),
        ("images", {}, 0, "images"),
        ("images", {"transform": "m:f"}, 0, "images"),
        ("images", {"preprocess": "m:f"}, 0, "images"),
        ("images", {"preprocess_on": {"role": "data"}}, 0, "ray_data"),
        ("images", {"cache": "always"}, 0, "materialize"),
        ("parquet", {"preprocess": "m:f"}, FITS, "stream"),  # exact: on the rank
        ("csv", {"preprocess": "m:f", "preprocess_on": {}}, TOO_BIG, "ray_data"),
        ("parquet", {"preprocess_on": {"role": "data"}}, TOO_BIG, "stream"),  # nothing to map
        ("parquet", {"preprocess": "m:f", "cache": "always"}, FITS, "materialize"),
    ],
)
def test_the_path_of_each_kind_of_split(fmt: str, fields: dict, nbytes: int, path: str) -> None:
    source = SourceSpec(uri="/data/x", format=fmt)
    data = DataSpec(train=source, **fields)
    assert choose_path(data, source, nbytes, STORE) == path
