"""An image folder as a list of files: listed once on the driver, decoded by each rank.

``list_images`` walks the folder (local or object storage) once, before Ray starts the
workers: one subfolder per class (torchvision's ``ImageFolder`` convention, the class index
being the folder's place in the sorted names) or the images directly in it (no labels).
The files are sorted by path, so the list, and every epoch's order cut from it
(``image_stream``), is the same on every rank and in every run.

``open_image`` is what each rank's decoding processes run on a file's bytes: Pillow, resized
then converted, as Ray Data's ``read_images`` does, so a set decodes alike on either path.
No torch here: the driver imports it.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from raytrain.contract import ImageSet

IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "tif", "tiff", "bmp", "gif", "webp")
HEAD_BYTES = 1 << 16  # what a header check reads of each file: Pillow's header needs less
CHECK_THREADS = 32  # header reads in flight on the driver (many small objects)


class BadImages(ValueError):
    """Files of an image folder that cannot be used; the message names them."""


def open_image(data: bytes, size: Sequence[int] | None = None, mode: str | None = None) -> Any:
    """An image file's bytes as a decoded PIL image: resized to ``size`` ((height, width),
    bilinear), then converted to the Pillow ``mode``, in Ray Data's order."""
    from PIL import Image

    image: Any = Image.open(io.BytesIO(data))
    image.load()
    if size is not None:
        image = image.resize((size[1], size[0]), resample=Image.Resampling.BILINEAR)
    if mode is not None:
        image = image.convert(mode)
    return image


def decode(data: bytes, size: Sequence[int] | None = None, mode: str | None = None) -> Any:
    """``open_image``'s pixels as a uint8 array, (H, W) or (H, W, C)."""
    import numpy as np

    return np.asarray(open_image(data, size, mode))


def is_image(path: str) -> bool:
    """Whether ``path`` has one of the image files' extensions (any case)."""
    return path.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS and "." in path.rsplit("/", 1)[-1]


def image_classes(fs: Any, path: str) -> list[str]:
    """The class names of an image folder: its subfolders, sorted (torchvision's
    ``ImageFolder`` convention); none when the images lie directly in it."""
    import pyarrow.fs as pafs

    entries = fs.get_file_info(pafs.FileSelector(path))
    return sorted(e.base_name for e in entries if e.type == pafs.FileType.Directory)


def image_problem(data: bytes) -> str | None:
    """Why Pillow cannot read an image from ``data`` (its first bytes will do), or None."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.size  # noqa: B018  # the header parsed
    except UnidentifiedImageError:
        return "not an image Pillow can read"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def header_problem(fs: Any, path: str) -> str | None:
    """Why Pillow cannot read the image at ``path`` from its first bytes, or None."""
    try:
        with fs.open_input_file(path) as handle:
            head = handle.read(HEAD_BYTES)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return image_problem(head)


PACK_MANIFEST = "_raytrain_pack.json"  # ``data.pack.MANIFEST``: a packed set's manifest


def packed_manifest(fs: Any, path: str) -> dict[str, Any] | None:
    """The manifest of images packed by ``raytrain pack`` at ``path``, or None: not packed
    images (no manifest, or one of packed rows)."""
    import json

    try:
        with fs.open_input_stream(f"{path.rstrip('/')}/{PACK_MANIFEST}") as handle:
            manifest = json.loads(handle.read())
    except Exception:
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == "images" else None


def list_images(uri: str, fs: Any, path: str, *, bad: str = "error", check: bool = True) -> ImageSet:
    """The image files under ``path`` (the folder ``uri`` names), sorted, with their labels.

    A class folder without images is a ``BadImages`` naming it, as is a folder with none at
    all. With ``check``, every file's header is read (``header_problem``, in threads): a
    file Pillow cannot read is a ``BadImages`` naming it (``bad: error``) or is left out and
    counted (``bad: skip``)."""
    import pyarrow.fs as pafs

    root = path.rstrip("/")
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    found = {i.path: i.size or 0 for i in infos
             if i.type == pafs.FileType.File and is_image(i.path)}  # fmt: skip
    files = sorted(found)
    top = image_classes(fs, root)
    if not files:
        raise BadImages(f"no image files ({', '.join(IMAGE_EXTENSIONS)}) under {uri}")
    skipped = 0
    if check:
        with ThreadPoolExecutor(CHECK_THREADS) as pool:
            problems = list(pool.map(lambda f: header_problem(fs, f), files))
        broken = [(f, why) for f, why in zip(files, problems, strict=True) if why]
        if broken and bad == "error":
            first, why = broken[0]
            more = f" (and {len(broken) - 1} more)" if len(broken) > 1 else ""
            raise BadImages(f"{first} does not decode: {why}{more}; set data.bad_images: skip "
                            "to train without such files")  # fmt: skip
        gone = {f for f, _ in broken}
        files, skipped = [f for f in files if f not in gone], len(broken)
    if not top:
        return ImageSet(uri=uri, files=tuple(files), labels=None, skipped=skipped,
                        sizes=tuple(found[f] for f in files))  # fmt: skip
    index = {name: i for i, name in enumerate(top)}
    labels, kept = [], []
    for f in files:
        parts = f[len(root) + 1 :].split("/")
        if len(parts) > 1:  # a file beside the class folders has no class: left out
            kept.append(f)
            labels.append(index[parts[0]])
    empty = sorted(set(top) - {top[i] for i in labels})
    if empty:
        raise BadImages(f"the class folder {root}/{empty[0]} has no image files"
                        + (f" (nor have {len(empty) - 1} more)" if len(empty) > 1 else ""))  # fmt: skip
    return ImageSet(uri=uri, files=tuple(kept), labels=tuple(labels), classes=tuple(top),
                    skipped=skipped, sizes=tuple(found[f] for f in kept))  # fmt: skip
