"""A train set mixed from two streamed sources, 0.8 and 0.2, that loses a worker mid-epoch
and is restored from its step checkpoint: the shares drawn, and every draw made exactly
once, from the model's own count of the rows it trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import raytrain
from raytrain.checkpoints.layout import CKPT_FILE, META_FILE
from raytrain.data.mix import quotas
from tests.conftest import digits_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EPOCHS, BATCH = 3, 24
KILL = 45  # epoch 1 runs steps 31-60 on 2 workers; the checkpoint before it is at 40


def test_a_mix_draws_its_shares_and_resumes_a_killed_worker_exactly(
    ray_cluster: None, digits_dir: Path, tmp_path: Path, clean_env: None
) -> None:
    train = pq.read_table(digits_dir / "train")
    parts = {"common": train.slice(0, 1000), "rare": train.slice(1000)}
    for name, table in parts.items():
        (tmp_path / name).mkdir()
        pq.write_table(table, tmp_path / name / "part-0.parquet", row_group_size=128)
    ids = {name: table.column("id").to_pylist() for name, table in parts.items()}
    num_ids = max(train.column("id").to_pylist()) + 1
    spec = digits_spec(
        digits_dir,
        tmp_path,
        name="mix",
        model={
            "class_path": "tests.integration.models:SeenCountCNN",
            "init_args": {
                "out_dir": str(tmp_path),
                "num_ids": num_ids,
                "at_steps": [KILL],
                "run_dir": str(tmp_path / "runs" / "mix"),
            },
        },
        data={
            "train": [
                {"uri": str(tmp_path / "common"), "weight": 0.8},
                {"uri": str(tmp_path / "rare"), "weight": 0.2},
            ],
            "columns": ["id", "pixels", "label"],
            "batch_size": BATCH,
            "shuffle": {"seed": 7, "buffer_size": 256},
            "cache": "never",
        },
        trainer={"max_epochs": EPOCHS, "log_every_n_steps": 5},
        checkpoint={"every_n_steps": 10, "keep": 20},
        failure={"max_failures": 1},
    )
    result = raytrain.fit(spec, progress=False)
    assert result.data_paths == {"train": "mixed", "val": "streamed"}
    assert result.metrics["step"] > KILL and result.metrics["epoch"] == EPOCHS - 1
    lines = [json.loads(x) for x in (tmp_path / "ids.jsonl").read_text().splitlines()]
    assert len({line["pid"] for line in lines}) == 4  # 2 ranks, restarted once

    # An epoch is all the sources' rows, 1437, drawn 0.8/0.2: the quotas, exact each epoch.
    epoch = sum(len(v) for v in ids.values())
    common_q, rare_q = quotas([0.8, 0.2], epoch)
    assert abs(rare_q / epoch - 0.2) <= 1 / epoch  # the stated tolerance: a row an epoch

    # The final model trained each source's draws once: every row of a source as often as
    # its passes over it gave (a pass is the whole source in a new order), none more.
    final = max(
        result.checkpoints, key=lambda c: json.loads((Path(c) / META_FILE).read_text())["step"]
    )
    seen = torch.load(Path(final) / CKPT_FILE, map_location="cpu", weights_only=False)
    counts = seen["state_dict"]["seen"]
    for name, drawn in (("common", EPOCHS * common_q), ("rare", EPOCHS * rare_q)):
        mine = counts[ids[name]]
        assert int(mine.sum()) == drawn
        full, extra = divmod(drawn, len(ids[name]))
        assert sorted(set(mine.tolist())) == sorted({full, full + 1} if extra else {full})
        assert int((mine == full + 1).sum()) == extra
    assert int(counts.sum()) == EPOCHS * epoch

    # What the run recorded: the rows each source gave, over all ranks.
    assert result.metrics["data/rows/common"] == EPOCHS * common_q
    assert result.metrics["data/rows/rare"] == EPOCHS * rare_q
