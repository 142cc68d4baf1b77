"""A real local Ray cluster for the integration tests, started once and stopped at the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray with room for 2 training workers plus Ray Data's budget."""
    from raytrain.ray_runtime import DATA_CPUS, start_local

    handle = start_local(2 + DATA_CPUS)
    yield
    handle.shutdown()
