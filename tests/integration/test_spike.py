"""A run that rolls back past loss spikes (``failure.spike``), for real: 2 workers on the
session's Ray cluster stream a Parquet set of the digits in which 3 rows are poisoned (their
pixels times 1000 and a wrong label: a trained model is then confidently wrong on them in
every epoch, so their batch's loss jumps and stays finite). In each of 2 epochs the ranks
agree on the spike at the poisoned batch, the run rolls back to its last checkpoint and
skips the rows of the steps up to and including that batch (rank 0's state kept in memory
every step is dropped at the spike: the rollback resumes from storage). The model counts
every row it trained on in a buffer saved with its weights (as in the mid-epoch resume
tests), so the final checkpoint shows the poisoned rows were never trained on, and exactly
the skipped ones once less."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import raytrain
from raytrain.checkpoints.layout import CKPT_FILE, META_FILE
from raytrain.records.rollback_record import read_rollbacks
from tests.conftest import digits_spec

pytestmark = pytest.mark.integration

EPOCHS = 2
# file positions: one batch of rank 0, whose block of each epoch (of 719 rows, streamed in
# file order) the file opens: its 51st
POISONED = (400, 401, 402)


def _poisoned_digits(digits_dir: Path, out: Path) -> tuple[list[int], list[int]]:
    """The digits' train split with the rows at ``POISONED`` made spikes; (all ids, the
    poisoned ids)."""
    table = pq.read_table(digits_dir / "train")
    pixels = np.array(table.column("pixels").to_pylist(), dtype=np.float32)
    labels = np.array(table.column("label").to_pylist())
    rows = list(POISONED)
    pixels[rows] *= 1000.0
    labels[rows] = (labels[rows] + 5) % 10
    kinds = {name: table.schema.field(name).type for name in ("pixels", "label")}
    table = table.set_column(
        table.schema.get_field_index("pixels"),
        "pixels",
        pa.array(list(pixels), type=kinds["pixels"]),
    )
    table = table.set_column(
        table.schema.get_field_index("label"), "label", pa.array(labels, type=kinds["label"])
    )
    out.mkdir()
    pq.write_table(table, out / "part-0.parquet")
    ids = table.column("id").to_pylist()
    return ids, [ids[i] for i in POISONED]


def test_loss_spikes_roll_back_and_skip_their_rows(
    ray_cluster: None, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    from mlflow.tracking import MlflowClient

    ids, poisoned = _poisoned_digits(digits_dir, tmp_path / "train")
    spec = digits_spec(
        digits_dir,
        tmp_path,
        name="spiky",
        model={
            "class_path": "tests.integration.models:SeenCountCNN",
            "init_args": {"out_dir": str(tmp_path), "num_ids": max(ids) + 1, "at_steps": []},
        },
        data={
            "train": {"uri": str(tmp_path / "train")},
            "columns": ["id", "pixels", "label"],
            "batch_size": 8,
            "shuffle": None,
            "cache": "never",
        },
        trainer={"max_epochs": EPOCHS, "log_every_n_steps": 10},
        # the state kept in memory every step: a rollback still goes back to storage
        checkpoint={"every_n_steps": 20, "keep": 3, "memory_every_n_steps": 1},
        failure={"spike": {"threshold": 50, "window": 10, "max_rollbacks": 2}},
    )
    result = raytrain.fit(spec, progress=False)
    assert result.data_paths["train"] == "streamed"  # each rank reads its block

    # one rollback an epoch, each to the last checkpoint before its spike
    rollbacks = read_rollbacks(result.run_dir)
    assert len(rollbacks) == EPOCHS, rollbacks
    for epoch, rollback in enumerate(rollbacks):
        assert rollback.epoch == epoch and rollback.z > 50
        assert rollback.restored_step is not None and rollback.rows_skipped is not None
        # the last committed checkpoint before the spike (Ray commits asynchronously, so
        # not always the last one taken)
        # not the in-memory state of the step before the spike: the keeper dropped it
        assert rollback.restored_step < rollback.step - 1
        # the steps from the checkpoint through the spiked batch: 16 rows a step
        assert rollback.rows_skipped == (rollback.step - rollback.restored_step) * 16
    skipped = sum(r.rows_skipped or 0 for r in rollbacks)

    # what the final model trained on: never a poisoned row, and each skipped row once less
    final = max(
        result.checkpoints, key=lambda c: json.loads((Path(c) / META_FILE).read_text())["step"]
    )
    seen = torch.load(Path(final) / CKPT_FILE, map_location="cpu", weights_only=False)[
        "state_dict"
    ]["seen"]
    assert seen[poisoned].tolist() == [0] * len(poisoned)
    assert set(seen[ids].tolist()) <= {0, 1, 2}
    assert int(EPOCHS * len(ids) - seen.sum()) == skipped
    steps_per_epoch = 90  # 1437 rows, 16 a step
    assert result.metrics["step"] == EPOCHS * steps_per_epoch - skipped // 16

    # and the run's MLflow record says so
    client = MlflowClient(result.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["raytrain.rollbacks"] == str(EPOCHS)
    assert (
        f"rolled back to step {rollbacks[0].restored_step}" in run.data.tags["raytrain.rollback.1"]
    )
    logged = client.download_artifacts(result.mlflow_run_id, "rollbacks.json", str(tmp_path))
    assert [r["step"] for r in json.loads(Path(logged).read_text())] == [r.step for r in rollbacks]
    assert run.data.tags.get("raytrain.restarts") == str(EPOCHS)
