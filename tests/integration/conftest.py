"""A real local Ray cluster for the integration tests, started once and stopped at the end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# Modules that connect this process to a Ray of their own: they run first, before anything
# asks for the session's embedded cluster, so that it is started once and never stopped and
# started again around them (a process connects to one cluster at a time).
OWN_CLUSTER_MODULES = ("test_multinode.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    if "soak" not in (config.getoption("-m") or ""):  # long fault soaks run on request only
        skip = pytest.mark.skip(reason="a soak: run it with -m soak")
        for item in items:
            if item.get_closest_marker("soak"):
                item.add_marker(skip)

    def rank(item: pytest.Item) -> int:  # tests elsewhere first; the sort is stable
        if here not in item.path.parents:
            return 0
        return 1 if item.path.name in OWN_CLUSTER_MODULES else 2

    items.sort(key=rank)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray with room for 2 training workers plus Ray Data's budget."""
    from raytrain.driver.ray_runtime import DATA_CPUS, start_local

    handle = start_local(2 + DATA_CPUS)
    yield
    handle.shutdown()


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3 API server (moto_server) on a free loopback port, for the session."""
    from tests.integration.s3_server import moto_server

    with moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as endpoint:
        yield endpoint


# Files per split in the S3 copy of the digits: a dataset of many files under a prefix. A
# streamed epoch reads each one again (one Ray Data read task per file, on 2 cores): 24 of
# them made the streamed S3 run's 2 epochs take 15 s.
S3_DIGITS_FILES = 8


@pytest.fixture(scope="session")
def s3_digits(s3_endpoint: str, digits_dir: Path) -> str:
    """The digits splits on the S3 server, each as a prefix of many Parquet files; returns
    the bucket's URI (``s3://raytrain-test``) with ``digits/train`` and ``digits/val``."""
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    from tests.integration.s3_server import s3_client, s3_filesystem

    s3_client(s3_endpoint).create_bucket(Bucket="raytrain-test")
    fs = s3_filesystem(s3_endpoint)
    for split in ("train", "val"):
        table = pq.read_table(digits_dir / split)
        rows = -(-table.num_rows // S3_DIGITS_FILES)
        where = f"raytrain-test/digits/{split}"
        pads.write_dataset(
            table,
            where,
            filesystem=fs,
            format="parquet",
            max_rows_per_file=rows,
            max_rows_per_group=rows,
        )
    return "s3://raytrain-test"
