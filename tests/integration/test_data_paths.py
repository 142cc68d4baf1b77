"""The other two ways a split reaches the workers: materialised by Ray Data, or streamed."""

from __future__ import annotations

from pathlib import Path

import pytest

import raytrain
from raytrain.data import sources as data
from tests.conftest import digits_spec

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("path", ["materialized", "streamed"])
def test_split_path_trains_the_same_steps(
    path: str,
    ray_cluster: None,
    digits_dir: Path,
    tmp_path: Path,
    clean_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(data, "DRIVER_READ_BYTES", 0)  # not read by the driver
    if path == "streamed":
        monkeypatch.setattr(data, "CACHE_FRACTION", 0.0)  # nothing fits: stream it
    spec = digits_spec(digits_dir, tmp_path, name=f"path-{path}", trainer={"max_epochs": 2})
    result = raytrain.fit(spec, progress=False)
    # 1,438 train rows, 2 equal shards of 719, batches of 32: 23 steps per epoch either way
    assert result.metrics["step"] == 2 * 23
    assert 0.0 < result.metrics["val_acc"] <= 1.0
    assert result.metrics["epoch"] == 1
