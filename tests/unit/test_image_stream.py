"""Image folders read by each rank (``image_files``, ``image_stream``): the listing and its
problems, and an epoch's batches over real PNG files, every image once per epoch, restores
on other world sizes that train exactly the images left, decoding in a forkserver pool."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from raytrain.data.image_files import BadImages, decode, list_images
from raytrain.data.image_stream import ImageFiles, ImageStream
from tests.image_folders import IMAGES, first_steps, ids_of, write_images


def streams(root: Path, world: int, workers: int = 0, **kwargs) -> list[ImageStream]:
    fs = pafs.LocalFileSystem()
    images = list_images(str(root), fs, str(root))
    return [
        ImageStream(
            ImageFiles(images, fs, None, None, **kwargs),
            8,
            rank=r,
            world_size=world,
            shuffle_seed=3,
            num_workers=workers,
        )
        for r in range(world)
    ]


def test_the_listing_is_sorted_with_class_labels_and_names_bad_folders(tmp_path: Path) -> None:
    write_images(tmp_path / "set", n=9)
    fs = pafs.LocalFileSystem()
    images = list_images("set", fs, str(tmp_path / "set"))
    assert images.classes == ("class-0", "class-1", "class-2") and images.num_rows == 9
    assert list(images.files) == sorted(images.files)
    assert [int(Path(f).parent.name[-1]) for f in images.files] == list(images.labels or ())
    (tmp_path / "set" / "class-3").mkdir()
    with pytest.raises(BadImages, match=r"class folder .*class-3 has no image files"):
        list_images("set", fs, str(tmp_path / "set"))
    (tmp_path / "set" / "class-3").rmdir()
    (tmp_path / "set" / "class-0" / "broken.png").write_text("not a png")
    with pytest.raises(BadImages, match=r"broken\.png does not decode: not an image"):
        list_images("set", fs, str(tmp_path / "set"))
    skipped = list_images("set", fs, str(tmp_path / "set"), bad="skip")
    assert skipped.skipped == 1 and skipped.files == images.files
    (tmp_path / "empty" / "a").mkdir(parents=True)
    (tmp_path / "empty" / "a" / "notes.txt").write_text("no images here")
    with pytest.raises(BadImages, match="no image files"):
        list_images("empty", fs, str(tmp_path / "empty"))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_image_once_per_epoch_equal_steps_with_labels(tmp_path: Path, world: int) -> None:
    write_images(tmp_path)
    ranks = streams(tmp_path, world)
    orders = []
    for epoch in (0, 1):
        got: list[int] = []
        per_rank = []
        for s in ranks:
            s.epoch = epoch
            batches = list(s)
            per_rank.append(len(batches))
            for batch in batches:
                assert batch["label"].tolist() == (batch["image"][:, 0, 2]).tolist()
                got += ids_of(batch)
        assert len(set(per_rank)) == 1 and per_rank[0] == len(ranks[0])
        assert sorted(got) == list(range(IMAGES))
        orders.append(got)
    assert orders[0] != orders[1]  # each epoch its own order


def test_a_restore_on_another_world_size_trains_exactly_the_images_left(tmp_path: Path) -> None:
    write_images(tmp_path)
    two = streams(tmp_path, 2)
    trained = first_steps(two, epoch=1, steps=2)
    states = [s.state_dict() for s in two]
    assert states[0] == states[1]  # every rank saves the same position
    (one,) = streams(tmp_path, 1, workers=1)  # and decoding in a process of its own
    one.load_state_dict(states[0])
    rest = [i for batch in one for i in ids_of(batch)]
    assert sorted(trained + rest) == list(range(IMAGES)) and len(one) == 2 + len(rest) // 8 + (
        len(rest) % 8 > 0
    )


def resize_and_flip(image):  # a transform, as torchvision's take a PIL image
    return np.asarray(image)[:, ::-1]


def test_decoding_resizes_converts_and_transforms_in_the_pool(tmp_path: Path) -> None:
    write_images(tmp_path, n=4, classes=1)
    data = (tmp_path / "class-0" / "0003.png").read_bytes()
    assert decode(data).shape == (6, 5) and decode(data, (3, 4), "RGB").shape == (3, 4, 3)
    (s,) = streams(tmp_path, 1, workers=2, transform="tests.unit.test_image_stream:resize_and_flip")
    batch = next(iter(s))
    assert batch["image"].shape == (4, 6, 5)
    assert sorted(batch["image"][:, 0, 4].tolist()) == [0, 0, 0, 0]  # id // 256, flipped
    assert sorted(batch["image"][:, 0, 3].tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("workers", [0, 1])
def test_an_image_that_does_not_decode_in_training_is_named(tmp_path: Path, workers: int) -> None:
    from raytrain.errors import BadDataError

    write_images(tmp_path, n=4, classes=1)
    (s,) = streams(tmp_path, 1, workers=workers)
    good = (tmp_path / "class-0" / "0002.png").read_bytes()
    (tmp_path / "class-0" / "0002.png").write_bytes(good[:40])  # truncated after the listing
    with pytest.raises(BadDataError, match=r"^data: the image .*0002\.png .* does not decode"):
        list(s)


def test_a_flat_folder_takes_its_labels_from_a_labels_file(tmp_path: Path) -> None:
    from raytrain.data.image_files import read_labels

    write_images(tmp_path / "nested", n=6)
    flat = tmp_path / "flat"
    flat.mkdir()
    for png in sorted((tmp_path / "nested").rglob("*.png")):
        png.rename(flat / png.name)
    fs = pafs.LocalFileSystem()
    names = tmp_path / "names.csv"
    names.write_text(
        "path,label\n" + "".join(f"{i:04d}.png,{'cat' if i % 2 else 'dog'}\n" for i in range(6))
    )
    images = list_images("flat", fs, str(flat), labels=read_labels(str(names)))
    assert images.classes == ("cat", "dog") and images.labels == (1, 0, 1, 0, 1, 0)
    numbers = tmp_path / "numbers.csv"
    numbers.write_text("label,path\n" + "".join(f"{i % 3},{i:04d}.png\n" for i in range(6)))
    images = list_images("flat", fs, str(flat), labels=read_labels(str(numbers)))
    assert images.classes == () and images.labels == (0, 1, 2, 0, 1, 2)
    numbers.write_text("path,label\n0000.png,1\n")
    with pytest.raises(BadImages, match=r"0001\.png has no label in the labels file \(and 4"):
        list_images("flat", fs, str(flat), labels=read_labels(str(numbers)))
    numbers.write_text("path,class\n0000.png,1\n")
    with pytest.raises(BadImages, match=r"numbers\.csv has no label column \(it has: path, class"):
        read_labels(str(numbers))
    numbers.write_text("path,label\n0000.png,1\n0000.png,2\n")
    with pytest.raises(BadImages, match=r"numbers\.csv, line 3: '0000\.png' is labelled twice"):
        read_labels(str(numbers))
    numbers.write_text("path,label\n0000.png, 1\n0001.png, \n")  # a space, an empty label
    with pytest.raises(BadImages, match=r"numbers\.csv, line 3: no path or no label"):
        read_labels(str(numbers))
    numbers.write_text("path,label\n" + "".join(f"{i:04d}.png,{i - 1}\n" for i in range(6)))
    with pytest.raises(BadImages, match=r"0000\.png's label -1 is no class index"):
        list_images("flat", fs, str(flat), labels=read_labels(str(numbers)))


def test_an_image_mode_pillow_lacks_and_a_huge_size_are_refused_by_the_spec() -> None:
    from pydantic import ValidationError

    from raytrain.spec import SourceSpec

    with pytest.raises(ValidationError, match=r"'XYZ' is not a Pillow mode: one of 1, CMYK"):
        SourceSpec(uri="/x", format="images", image_mode="XYZ")
    with pytest.raises(ValidationError, match=r"at most 16384, got \[100000, 8\]"):
        SourceSpec(uri="/x", format="images", image_size=(100000, 8))


def test_images_of_different_shapes_in_a_batch_are_named_with_the_fix(tmp_path: Path) -> None:
    from PIL import Image

    from raytrain.errors import BadDataError

    write_images(tmp_path, n=4, classes=1)
    Image.new("RGB", (5, 6)).save(tmp_path / "class-0" / "0002.png")  # RGB among grey
    (s,) = streams(tmp_path, 1)
    with pytest.raises(
        BadDataError,
        match=r"differ in shape within a batch: .* is \(6, 5\), "
        r".*0002\.png is \(6, 5, 3\); set the source's image_size",
    ):
        list(s)


def broken_transform(image):  # a transform with a bug
    return image.nosuch()


def test_a_transform_that_raises_is_named_with_its_image(tmp_path: Path) -> None:
    from raytrain.errors import BadDataError

    write_images(tmp_path, n=2, classes=1)
    (s,) = streams(
        tmp_path, 1, workers=1, transform="tests.unit.test_image_stream:broken_transform"
    )
    with pytest.raises(
        BadDataError,
        match=r"^data\.transform tests\.unit\.test_image_stream:"
        r"broken_transform failed on .*\.png: AttributeError",
    ):
        list(s)
