"""A streamed train set (each rank reading its Parquet row groups, or its blocks of CSV or
JSON Lines) that loses a worker twice
mid-epoch: restored once on the same 2 workers, then, its failures spent, resumed by the
same spec on 1 worker. Every row is trained exactly once per epoch throughout.

The train set has an odd number of rows (an equal split between 2 ranks would have to drop
one) in 4 files of 100-row row groups, shuffled in windows of 300 rows. The model counts,
in a buffer saved with its weights, how often each row went into a step, and each rank
writes the rows of each step it trains (``SeenCountCNN``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

import raytrain
from raytrain.checkpoints.layout import CKPT_FILE, META_FILE
from raytrain.data.order import step_slices
from tests.conftest import digits_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EPOCHS, BATCH, EVERY = 3, 24, 10
KILLS = (45, 75)  # in epoch 1 (steps 31-60) and epoch 2 (61-90), 5 steps after a checkpoint


def _step(checkpoint: str) -> int:
    return json.loads((Path(checkpoint) / META_FILE).read_text())["step"]


def write_part(table: pa.Table, path: Path, fmt: str) -> None:
    """A part of the train set as Parquet (100-row row groups), CSV (``pixels`` as the
    columns ``p0``..``p63``) or JSON Lines (``pixels`` a list)."""
    if fmt == "parquet":
        pq.write_table(table, path.with_suffix(".parquet"), row_group_size=100)
    elif fmt == "csv":
        pixels = table.column("pixels").to_pylist()
        columns = {
            "id": table.column("id"),
            **{f"p{k}": pa.array([p[k] for p in pixels]) for k in range(64)},
            "label": table.column("label"),
        }
        pacsv.write_csv(pa.table(columns), path.with_suffix(".csv"))
    else:
        rows = table.to_pylist()
        path.with_suffix(".json").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("fmt", ["parquet", "csv", "json"])
def test_a_streamed_set_killed_mid_epoch_and_resumed_on_fewer_workers_trains_each_row_once(
    ray_cluster: None,
    digits_dir: Path,
    tmp_path: Path,
    clean_env: None,
    monkeypatch: pytest.MonkeyPatch,
    fmt: str,
) -> None:
    from raytrain.data import text_blocks

    # text files split into blocks of about 100 rows, as the Parquet parts' row groups
    monkeypatch.setattr(text_blocks, "BLOCK_BYTES", 100 * (700 if fmt == "json" else 350))
    train = pq.read_table(digits_dir / "train")
    train = train.slice(0, train.num_rows - (1 - train.num_rows % 2))  # odd
    (tmp_path / "train").mkdir()
    quarter = train.num_rows // 4 + 1
    for i in range(4):
        write_part(train.slice(i * quarter, quarter), tmp_path / "train" / f"part-{i}", fmt)
    ids = train.column("id").to_pylist()
    num_ids = max(ids + pq.read_table(digits_dir / "val", columns=["id"])["id"].to_pylist()) + 1
    steps = len(step_slices(len(ids), BATCH, 2))  # an epoch's steps on 2 workers: 30

    def spec(workers: int) -> dict:
        return digits_spec(
            digits_dir,
            tmp_path,
            name="stream-resume",
            model={
                "class_path": "tests.integration.models:SeenCountCNN",
                "init_args": {
                    "out_dir": str(tmp_path),
                    "num_ids": num_ids,
                    "at_steps": list(KILLS),
                    "run_dir": str(tmp_path / "runs" / "stream-resume"),
                },
            },
            data={
                "train": {"uri": str(tmp_path / "train"), "format": fmt},
                "columns": None if fmt == "csv" else ["id", "pixels", "label"],
                "batch_size": BATCH,
                "shuffle": {"seed": 7, "buffer_size": 300},
                "cache": "never",
            },
            scaling={"num_workers": workers},
            trainer={"max_epochs": EPOCHS},
            checkpoint={"every_n_steps": EVERY, "keep": 20, "memory_every_n_steps": "off"},
            failure={"max_failures": 1},
        )

    with pytest.raises(raytrain.TrainingFailed):  # the second kill spends the failures
        raytrain.fit(spec(2), progress=False)
    result = raytrain.fit(spec(1), progress=False)  # (rank 1, which kills, is gone)
    assert result.data_paths == {"train": "streamed", "val": "streamed"}
    assert result.resumed_from is not None and _step(result.resumed_from) == KILLS[1] - 5
    assert result.metrics["world_size"] == 1 and result.metrics["epoch"] == EPOCHS - 1

    # The final model trained on every training row exactly once per epoch.
    final = max(result.checkpoints, key=_step)
    seen = torch.load(Path(final) / CKPT_FILE, map_location="cpu", weights_only=False)
    counts = seen["state_dict"]["seen"]
    assert counts[ids].tolist() == [EPOCHS] * len(ids) and int(counts.sum()) == EPOCHS * len(ids)

    # By the ranks' own records: 3 attempts (2 workers, 2 workers, 1 worker).
    lines = [json.loads(x) for x in (tmp_path / "ids.jsonl").read_text().splitlines()]
    attempts: list[list[int]] = []  # pids by attempt, in the order they first wrote
    for line in lines:
        if not any(line["pid"] in a for a in attempts):
            if not attempts or len(attempts[-1]) == (1 if len(attempts) == 3 else 2):
                attempts.append([])
            attempts[-1].append(line["pid"])
    assert [len(a) for a in attempts] == [2, 2, 1]
    rows: list[dict[tuple[int, int], list[int]]] = [defaultdict(list) for _ in attempts]
    for line in lines:
        n = next(i for i, a in enumerate(attempts) if line["pid"] in a)
        rows[n][line["rank"], line["step"]] += line["ids"]
    # The restore on 2 workers retrained exactly what each rank had trained in steps 41-45.
    first, second, third = rows
    assert min(s for _, s in second) == KILLS[0] - 5
    for rank in (0, 1):
        for s in range(KILLS[0] - 5, KILLS[0] + 1):
            assert sorted(second[rank, s]) == sorted(first[rank, s])
    # Epoch 2, from its first step to the checkpoint at 70 on 2 workers, then the rest on 1:
    # each row once, none twice.
    before = [i for (_, s), got in second.items() if 2 * steps <= s < KILLS[1] - 5 for i in got]
    after = [i for got in third.values() for i in got]
    assert min(s for _, s in third) == KILLS[1] - 5
    assert sorted(before + after) == sorted(ids)
    # and the shuffle gave each epoch its own order
    order = [
        [
            i
            for s in range(e * steps, e * steps + 5)
            for i in second.get((0, s), []) or first.get((0, s), [])
        ]
        for e in range(2)
    ]
    assert order[0] != order[1]
