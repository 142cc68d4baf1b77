"""Image folders the image tests write: PNGs whose pixels say which image they are."""

from __future__ import annotations

from pathlib import Path

import numpy as np

IMAGES = 61  # odd: an equal split over 2 ranks would drop one


def write_images(root: Path, n: int = IMAGES, classes: int = 3) -> None:
    """``n`` 6x5 grey PNGs in ``classes`` class folders; image i's first two pixels hold i
    (i // 256, i % 256) and its third its class."""
    from PIL import Image

    for i in range(n):
        folder = root / f"class-{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.zeros((6, 5), dtype=np.uint8)
        pixels[0, :3] = [i // 256, i % 256, i % classes]
        Image.fromarray(pixels).save(folder / f"{i:04d}.png")


def ids_of(batch: dict) -> list[int]:
    image = batch["image"].numpy().astype(int)
    return (image[:, 0, 0] * 256 + image[:, 0, 1]).tolist()


def first_steps(ranks: list, epoch: int, steps: int) -> list[int]:
    """The ids every rank's loader trains in the first ``steps`` steps of ``epoch``, each
    told its position as Lightning tells it (``LoaderPosition``)."""
    trained: list[int] = []
    for s in ranks:
        s.epoch = epoch
        for position, batch in enumerate(s, start=1):
            s.position = position
            trained += ids_of(batch)
            if position == steps:
                break
    return trained


def write_digit_images(root: Path, first: int, n: int) -> None:
    """scikit-learn's digits ``first`` to ``first + n`` as 9x8 grey PNGs in ``root/{label}/``:
    the digit's pixels (0..255) over a row holding the image's index."""
    from PIL import Image
    from sklearn.datasets import load_digits

    bunch = load_digits()
    for i in range(first, first + n):
        folder = root / str(bunch.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.zeros((9, 8), dtype=np.uint8)
        pixels[:8] = np.clip(bunch.images[i] * 16, 0, 255)
        pixels[8, :2] = [i // 256, i % 256]
        Image.fromarray(pixels).save(folder / f"{i:05d}.png")
