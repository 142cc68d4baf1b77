"""Mid-epoch resume: a step checkpoint records the position in the data, so a run restored
from it trains the rest of that epoch, not the epoch again from its first batch.

The model counts, in a buffer saved with its weights, how often each training row went into
a step. Across a worker killed mid-epoch, the final model must have trained on every row
exactly once per epoch, and the restarted workers must retrain exactly the rows that were
trained between the committed checkpoint and the kill.
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
from tests.conftest import digits_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EPOCHS = 2
EVERY = 10  # step checkpoints at 10, 20, 30, 40 (23 steps an epoch)
KILL = 35  # in epoch 1, after the checkpoint at step 30, which is 7 batches into it


def test_a_run_killed_mid_epoch_trains_every_row_once_per_epoch(
    ray_cluster: None, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    train_ids = pq.read_table(digits_dir / "train", columns=["id"]).column("id").to_pylist()
    val_ids = pq.read_table(digits_dir / "val", columns=["id"]).column("id").to_pylist()
    num_ids = max(train_ids + val_ids) + 1
    spec = digits_spec(
        digits_dir, tmp_path, name="mid-epoch",
        model={"class_path": "tests.integration.models:SeenCountCNN",
               "init_args": {"out_dir": str(tmp_path), "num_ids": num_ids, "at_steps": [KILL],
                             "run_dir": str(tmp_path / "runs" / "mid-epoch")}},
        data={"columns": ["id", "pixels", "label"], "shuffle": {"seed": 3}},
        trainer={"max_epochs": EPOCHS},
        checkpoint={"every_n_steps": EVERY, "keep": 10},
        failure={"max_failures": 1},
    )  # fmt: skip
    result = raytrain.fit(spec, progress=False)

    # The run restarted once, from the step-30 checkpoint, and ended at 2 whole epochs.
    lines = [json.loads(x) for x in (tmp_path / "ids.jsonl").read_text().splitlines()]
    pids = list(dict.fromkeys(line["pid"] for line in lines))
    assert len(pids) == 4  # 2 ranks, 2 attempts
    first = {p for p in pids if any(x["pid"] == p and x["step"] == 0 for x in lines)}
    restarted_steps = [x["step"] for x in lines if x["pid"] not in first]
    assert min(restarted_steps) == 3 * EVERY  # the first step after the restore is step 31
    assert result.metrics["step"] == EPOCHS * 23

    # The final model trained on every training row exactly once per epoch (and on no val row).
    def step(checkpoint: str) -> int:
        return json.loads((Path(checkpoint) / META_FILE).read_text())["step"]

    final = max(result.checkpoints, key=step)
    state = torch.load(Path(final) / CKPT_FILE, map_location="cpu", weights_only=False)
    seen = state["state_dict"]["seen"]
    assert seen[train_ids].tolist() == [EPOCHS] * len(train_ids)
    assert int(seen.sum()) == EPOCHS * len(train_ids)

    # Retrained: exactly the rows of steps 31..35 the first attempt trained before the kill.
    by_step: dict[bool, dict[int, list[int]]] = {True: defaultdict(list), False: defaultdict(list)}
    for line in lines:
        by_step[line["pid"] in first][line["step"]].extend(line["ids"])
    lost = {s: sorted(ids) for s, ids in by_step[True].items() if s >= 3 * EVERY}
    assert sorted(lost) == list(range(3 * EVERY, KILL + 1))
    assert {s: sorted(by_step[False][s]) for s in lost} == lost
