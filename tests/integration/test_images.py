"""An image folder (one folder per class) read by each rank itself, under faults: 600 PNG
images, 4 epochs on 2 workers, a worker SIGKILLed mid-epoch twice (restored once on 2
workers, then, its failures spent, resumed by the same spec on 1 worker). The model reads
each image's index from its pixels and counts, in a buffer saved with its weights, how often
it trained each one: every image exactly 4 times. A ``data.preprocess`` runs in each rank's
decoding processes at 2 ms a row, so the run is data-bound and ``raytrain doctor`` says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import raytrain
from raytrain.checkpoints.layout import CKPT_FILE, META_FILE
from raytrain.cli.app import main
from raytrain.data.order import step_slices
from tests.conftest import digits_spec
from tests.image_folders import write_digit_images

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EPOCHS, BATCH, TRAIN, VAL = 4, 32, 600, 200
KILLS = (15, 27)  # mid-epoch 1 (steps 10-19) and mid-epoch 2 (20-29), 10 steps an epoch


def test_image_folders_killed_mid_epoch_and_resumed_on_fewer_workers_train_each_image_4_times(
    ray_cluster: None,
    digits_dir: Path,
    tmp_path: Path,
    clean_env: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    write_digit_images(tmp_path / "images" / "train", 0, TRAIN)
    write_digit_images(tmp_path / "images" / "val", TRAIN, VAL)
    image = {"format": "images", "image_mode": "L"}
    steps = len(step_slices(TRAIN, BATCH, 2))
    assert steps == 10

    def spec(workers: int) -> dict:
        return digits_spec(
            digits_dir,
            tmp_path,
            name="images",
            model={
                "class_path": "tests.integration.models:SeenCountCNN",
                "init_args": {
                    "out_dir": str(tmp_path),
                    "num_ids": TRAIN + VAL,
                    "at_steps": list(KILLS),
                    "lr": 0.01,
                    "run_dir": str(tmp_path / "runs" / "images"),
                },
            },
            data={
                "train": {"uri": str(tmp_path / "images" / "train"), **image},
                "val": {"uri": str(tmp_path / "images" / "val"), **image},
                "columns": None,
                "batch_size": BATCH,
                "shuffle": {"seed": 3},
                "num_workers": 1,
                "preprocess": "tests.integration.models:digit_and_id",
            },
            scaling={"num_workers": workers},
            trainer={"max_epochs": EPOCHS},
            checkpoint={"every_n_steps": 5, "keep": 20},
            failure={"max_failures": 1},
        )

    with pytest.raises(raytrain.TrainingFailed):  # the second kill spends the failures
        raytrain.fit(spec(2), progress=False)
    result = raytrain.fit(spec(1), progress=False)  # (rank 1, which kills, is gone)
    assert result.data_paths == {"train": "streamed", "val": "streamed"}
    assert result.resumed_from is not None
    assert result.metrics["world_size"] == 1 and result.metrics["epoch"] == EPOCHS - 1

    # Every training image exactly once per epoch, through both faults and the resize.
    final = max(
        result.checkpoints, key=lambda c: json.loads((Path(c) / META_FILE).read_text())["step"]
    )
    state = torch.load(Path(final) / CKPT_FILE, map_location="cpu", weights_only=False)
    seen = state["state_dict"]["seen"]
    assert seen[:TRAIN].tolist() == [EPOCHS] * TRAIN, np.bincount(seen[:TRAIN].numpy())
    assert int(seen[TRAIN:].sum()) == 0  # val images are never trained
    # Labels come from the class folders: a model that learns them beats chance (0.1) well.
    assert result.metrics["val_acc"] >= 0.8

    # `raytrain doctor` of the run: data-bound, the wait's share with its numbers
    code = main(
        [
            "doctor",
            "images",
            "--storage",
            spec(1)["checkpoint"]["storage"],
            "--tracking-uri",
            spec(1)["tracking"]["mlflow"]["tracking_uri"],
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    lines = lines[lines.index("images:") :]  # after what Ray printed of the killed workers
    assert lines[1].startswith("  data-bound: each step waited "), lines
