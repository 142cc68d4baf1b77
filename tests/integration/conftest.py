"""A real local Ray cluster for the integration tests, started once and stopped at the end."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray with room for 2 training workers plus Ray Data's budget."""
    import ray

    from raytrain.ray_runtime import DATA_CPUS

    ray.init(
        num_cpus=2 + DATA_CPUS,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    yield
    ray.shutdown()
