"""With the train set cached, every row is trained on exactly once per epoch, and a seeded
shuffle gives each epoch its own order (real 2-worker DDP run, ids recorded by the model).
The splits are cached the way a split too big for the driver's own read is: materialised
by Ray Data (the driver's read is what every other digits run here takes)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import raytrain
from raytrain.data import sources
from tests.conftest import digits_spec

pytestmark = pytest.mark.integration

EPOCHS = 3


def test_every_row_once_per_epoch_and_a_new_order_each_epoch(
    ray_cluster: None,
    digits_dir: Path,
    tmp_path: Path,
    clean_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sources, "DRIVER_READ_BYTES", 0)  # not read by the driver
    seen_dir = tmp_path / "seen"
    seen_dir.mkdir()
    # an odd row count, so an equal split between 2 ranks would have to drop a row
    train = pq.read_table(digits_dir / "train")
    (tmp_path / "train").mkdir()
    pq.write_table(train.slice(0, train.num_rows - 1), tmp_path / "train" / "part-0.parquet")
    spec = digits_spec(
        digits_dir,
        tmp_path,
        name="sampling",
        model={
            "class_path": "tests.integration.models:IdRecordingCNN",
            "init_args": {"out_dir": str(seen_dir)},
        },
        data={
            "train": {"uri": str(tmp_path / "train")},
            "columns": ["id", "pixels", "label"],
            "batch_size": 24,
            "shuffle": {"seed": 7},
        },
        trainer={"max_epochs": EPOCHS},
    )
    result = raytrain.fit(spec, progress=False)
    assert result.data_paths == {"train": "cached", "val": "cached"}
    assert 0.0 < result.metrics["val_acc"] <= 1.0
    assert result.metrics["epoch"] == EPOCHS - 1

    ids = sorted(pq.read_table(tmp_path / "train", columns=["id"]).column("id").to_pylist())
    assert len(ids) % 2 == 1
    orders = []
    for epoch in range(EPOCHS):
        ranks = [json.loads((seen_dir / f"rank{r}-epoch{epoch}.json").read_text()) for r in (0, 1)]
        assert sorted(ranks[0] + ranks[1]) == ids  # every row, none twice, none dropped
        orders.append(ranks)
    # a seeded shuffle still reorders every epoch, and globally: a rank's rows change too
    assert orders[0][0] != orders[1][0] != orders[2][0]
    assert set(orders[0][0]) != set(orders[1][0])
