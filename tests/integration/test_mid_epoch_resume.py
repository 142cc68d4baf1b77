"""A run killed mid-epoch, on a cached train set: every row is trained on exactly once per
epoch, a seeded shuffle gives each epoch its own order, and the restore trains the rest of
the epoch it was in, not the epoch again from its first batch.

A step checkpoint records the position in the data. The model counts, in a buffer saved with
its weights, how often each training row went into a step, and each rank writes the rows of
each step it trains. Across a worker killed mid-epoch, the final model must have trained on
every row exactly once per epoch, and the restarted workers must retrain exactly the rows
that were trained between the committed checkpoint and the kill.

Rank 0 keeps its state in memory every step (``checkpoint.memory_every_n_steps: 1``), and
the kills come at the first batch of an epoch, right after the last batch of the one
before: a state taken there before the epoch's end ran once resumed into an epoch of no
batches (the run ended at step 60 of 90; a soak's rerun trained 4 epochs of 6). So that
state is not kept in memory: the first kill (no checkpoint in storage yet) resumes from the
step before it and retrains the epoch's last batch. And a step checkpoint due at an epoch's
last batch is taken at the epoch's end instead: the second kill resumes from it, at step
60 (the state in memory, of step 59, is older). No metric step reaches MLflow twice.

The train set has an odd number of rows (an equal split between 2 ranks would have to drop
one). It is cached the way a split too big for the driver's own read is, materialised by Ray
Data (the driver's read is what every other digits run here takes).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import raytrain
from raytrain.checkpoints.layout import CKPT_FILE, META_FILE
from raytrain.data import sources
from raytrain.data.order import step_slices
from tests.conftest import digits_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EPOCHS, BATCH, WORKERS = 3, 24, 2
EVERY = 60  # a step checkpoint due at step 60, epoch 1's last batch (an epoch: 30 steps)
KILLS = (30, 60)  # at the first batch of epochs 1 and 2


def test_a_run_killed_mid_epoch_trains_every_row_once_per_epoch_in_a_new_order(
    ray_cluster: None,
    digits_dir: Path,
    tmp_path: Path,
    clean_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sources, "DRIVER_READ_BYTES", 0)  # not read by the driver
    train = pq.read_table(digits_dir / "train")
    (tmp_path / "train").mkdir()
    pq.write_table(train.slice(0, train.num_rows - 1), tmp_path / "train" / "part-0.parquet")
    train_ids = pq.read_table(tmp_path / "train", columns=["id"]).column("id").to_pylist()
    assert len(train_ids) % 2 == 1
    every_id = train.column("id").to_pylist()
    every_id += pq.read_table(digits_dir / "val", columns=["id"]).column("id").to_pylist()
    steps = len(step_slices(len(train_ids), BATCH, WORKERS))  # an epoch's steps: 30
    spec = digits_spec(
        digits_dir,
        tmp_path,
        name="mid-epoch",
        model={
            "class_path": "tests.integration.models:SeenCountCNN",
            "init_args": {
                "out_dir": str(tmp_path),
                "num_ids": max(every_id) + 1,
                "at_steps": list(KILLS),
                "run_dir": str(tmp_path / "runs" / "mid-epoch"),
            },
        },
        data={
            "train": {"uri": str(tmp_path / "train")},
            "columns": ["id", "pixels", "label"],
            "batch_size": BATCH,
            "shuffle": {"seed": 7},
        },
        trainer={"max_epochs": EPOCHS},
        checkpoint={
            "every_n_steps": EVERY,
            "every_n_epochs": None,
            "keep": 20,
            "memory_every_n_steps": 1,
        },
        failure={"max_failures": 2},
    )
    result = raytrain.fit(spec, progress=False)
    assert result.data_paths == {"train": "cached", "val": "cached"}
    assert 0.0 < result.metrics["val_acc"] <= 1.0
    assert result.metrics["epoch"] == EPOCHS  # the end's checkpoint: the epochs done
    assert result.metrics["step"] == EPOCHS * steps

    # The run restarted twice: from rank 0's state in memory, of the step before the epoch's
    # last (or, were its send still on its way, the one before); then from the checkpoint
    # in storage of epoch 1's end, at step 60, taken at the epoch's end (its meta says so).
    lines = [json.loads(x) for x in (tmp_path / "ids.jsonl").read_text().splitlines()]
    pids = list(dict.fromkeys(line["pid"] for line in lines))
    assert len(pids) == 6  # 2 ranks, 3 attempts
    attempt = {pid: i // 2 for i, pid in enumerate(pids)}
    by_attempt: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(3)]
    for line in lines:
        by_attempt[attempt[line["pid"]]][line["step"]].extend(line["ids"])
    # the first step after a restore is the restored one + 1 (a line's step: global_step)
    restored = [min(by_attempt[a]) for a in (1, 2)]
    assert KILLS[0] - 2 <= restored[0] < KILLS[0] and restored[1] == KILLS[1], restored

    # The final model trained on every training row exactly once per epoch (and on no other).
    def step(checkpoint: str) -> int:
        return json.loads((Path(checkpoint) / META_FILE).read_text())["step"]

    final = max(result.checkpoints, key=step)
    metas = [json.loads((Path(c) / META_FILE).read_text()) for c in result.checkpoints]
    assert [(m["step"], m["kind"]) for m in sorted(metas, key=lambda m: m["step"])] == [
        (KILLS[1], "epoch"),
        (EPOCHS * steps, "end"),
    ]
    state = torch.load(Path(final) / CKPT_FILE, map_location="cpu", weights_only=False)
    seen = state["state_dict"]["seen"]
    assert seen[train_ids].tolist() == [EPOCHS] * len(train_ids)
    assert int(seen.sum()) == EPOCHS * len(train_ids)

    # Retrained: exactly the rows of the steps from the restored one to the kill's (whose
    # batch the attempt before began) that the attempt before trained.
    for a, kill in ((1, KILLS[0]), (2, KILLS[1])):
        before, after = by_attempt[a - 1], by_attempt[a]
        lost = {s: sorted(ids) for s, ids in before.items() if s >= restored[a - 1]}
        assert sorted(lost) == list(range(restored[a - 1], kill + 1))
        assert {s: sorted(after[s]) for s in lost} == lost

    # One MLflow run; no metric step logged twice or going back.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(result.tracking_uri)
    assert client.get_run(result.mlflow_run_id).data.tags["raytrain.restarts"] == "2"
    for key in ("train_loss", "val_acc"):
        logged = [m.step for m in client.get_metric_history(result.mlflow_run_id, key)]
        assert logged and logged == sorted(set(logged)), (key, logged)

    # Each epoch's order, per rank, as the model was trained (a retrained step: its rows the
    # second time): every row once per epoch, none twice, none dropped; and a seeded
    # shuffle still reorders every epoch, and globally: a rank's rows change too.
    trained: dict[tuple[int, int], list[int]] = {}
    for line in lines:  # in the order written: a later attempt's step replaces the earlier
        trained[line["rank"], line["step"]] = line["ids"]
    orders = [
        [
            [i for s in range(e * steps, (e + 1) * steps) for i in trained[rank, s]]
            for rank in range(WORKERS)
        ]
        for e in range(EPOCHS)
    ]
    for epoch in orders:
        assert sorted(epoch[0] + epoch[1]) == sorted(train_ids)
    assert orders[0][0] != orders[1][0] != orders[2][0]
    assert set(orders[0][0]) != set(orders[1][0])
