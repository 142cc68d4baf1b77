"""Image files under a prefix, one folder per class: decoded and resized on Ray Data
workers, turned into model inputs by a ``data.preprocess`` step, streamed to 2 workers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import raytrain
from raytrain.cli.app import main
from tests.conftest import digits_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EPOCHS = 2


def write_digit_images(root: Path) -> dict[str, int]:
    """scikit-learn's digits as 16x16 grey PNGs in ``root/{train,val}/{label}/``, twice the
    size the job asks for (so the reader's resize is what makes them 8x8 again)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    bunch = load_digits()
    order = np.random.default_rng(0).permutation(len(bunch.target))
    n_val = len(order) // 5
    counts = {}
    for split, rows in (("val", order[:n_val]), ("train", order[n_val:])):
        for row in rows:
            folder = root / split / str(bunch.target[row])
            folder.mkdir(parents=True, exist_ok=True)
            pixels = np.clip(bunch.images[row] * 16, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).resize((16, 16), Image.NEAREST).save(folder / f"{row}.png")
        counts[split] = len(rows)
    return counts


def test_image_folders_train_through_preprocess(
    ray_cluster: None,
    digits_dir: Path,
    tmp_path: Path,
    clean_env: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    counts = write_digit_images(tmp_path / "images")
    image = {"format": "images", "image_size": [8, 8], "image_mode": "L"}
    # Every epoch decodes the files again (Ray Data re-executes a streamed dataset), so the
    # run is kept to 2 epochs, at a learning rate that gets there in 2.
    spec = digits_spec(digits_dir, tmp_path, name="images", trainer={"max_epochs": EPOCHS},
                       model={"class_path": "raytrain.models.digits:DigitsCNN",
                              "init_args": {"lr": 0.01}})  # fmt: skip
    spec["data"] = {
        **spec["data"],
        "train": {"uri": str(tmp_path / "images" / "train"), **image},
        "val": {"uri": str(tmp_path / "images" / "val"), **image},
        "columns": None,
        # 2 ms a row: the workers wait for their batches, and `raytrain doctor` says so
        "preprocess": "tests.integration.models:slow_images_to_pixels",
    }
    result = raytrain.fit(spec, progress=False)
    assert result.data_paths == {"train": "streamed", "val": "streamed"}
    # An equal streaming split of the train images over 2 workers, 32 a batch.
    steps = -(-(counts["train"] // 2) // 32)
    assert result.metrics["step"] == EPOCHS * steps
    # Labels come from the class folders: a model that learns them beats chance (0.1) well.
    assert result.metrics["val_acc"] >= 0.8

    # `raytrain doctor` of the run: data-bound, the wait's share with its numbers
    assert (
        main(
            [
                "doctor",
                "images",
                "--storage",
                spec["checkpoint"]["storage"],
                "--tracking-uri",
                spec["tracking"]["mlflow"]["tracking_uri"],
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "images:" and lines[1].startswith("  data-bound: each step waited "), lines
