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
from typing import TYPE_CHECKING, Any

from raytrain.contract import ImageSet

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image
    from pyarrow.fs import FileSystem

    from raytrain.spec import StorageSpec

IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "tif", "tiff", "bmp", "gif", "webp")
HEAD_BYTES = 1 << 16  # what a header check reads of each file: Pillow's header needs less
CHECK_THREADS = 32  # header reads in flight on the driver (many small objects)


class BadImages(ValueError):
    """Files of an image folder that cannot be used; the message names them."""


def open_image(
    data: bytes, size: Sequence[int] | None = None, mode: str | None = None
) -> Image.Image:
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


def decode(data: bytes, size: Sequence[int] | None = None, mode: str | None = None) -> np.ndarray:
    """``open_image``'s pixels as a uint8 array, (H, W) or (H, W, C)."""
    import numpy as np

    return np.asarray(open_image(data, size, mode))


def is_image(path: str) -> bool:
    """Whether ``path`` has one of the image files' extensions (any case)."""
    return path.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS and "." in path.rsplit("/", 1)[-1]


def image_classes(fs: FileSystem, path: str) -> list[str]:
    """The class names of an image folder: its subfolders, sorted (torchvision's
    ``ImageFolder`` convention); none when the images lie directly in it."""
    import pyarrow.fs as pafs

    entries = fs.get_file_info(pafs.FileSelector(path))
    return sorted(e.base_name for e in entries if e.type == pafs.FileType.Directory)


def image_problem(data: bytes, whole: bool = False) -> str | None:
    """Why Pillow cannot read an image from ``data`` (its first bytes will do), or None;
    ``whole``: decoded to its last pixel, so a truncated file is found too."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            if whole:
                image.load()
            image.size  # noqa: B018  # the header parsed
    except UnidentifiedImageError:
        return "not an image Pillow can read"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def header_problem(fs: FileSystem, path: str) -> str | None:
    """Why Pillow cannot read the image at ``path`` from its first bytes, or None."""
    try:
        with fs.open_input_file(path) as handle:
            head = handle.read(HEAD_BYTES)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return image_problem(head)


PACK_MANIFEST = "_raytrain_pack.json"  # ``data.pack.MANIFEST``: a packed set's manifest


def pack_manifest(fs: FileSystem, path: str) -> dict[str, Any] | None:
    """The manifest ``raytrain pack`` wrote at ``path``, or None (not a pack's folder). An
    unfinished pack (interrupted, or stopped at a bad file) is a ``BadImages`` saying so: its
    shards are a mix of the old and the new."""
    import json

    try:
        with fs.open_input_stream(f"{path.rstrip('/')}/{PACK_MANIFEST}") as handle:
            manifest = json.loads(handle.read())
    except Exception:
        return None
    if not isinstance(manifest, dict):
        return None
    if manifest.get("complete") is False:
        raise BadImages(
            f"{path} is an unfinished pack of {manifest.get('source')} (raytrain "
            "pack was stopped before its end): run the same raytrain pack again"
        )
    return manifest


def packed_manifest(fs: FileSystem, path: str) -> dict[str, Any] | None:
    """The manifest of images packed by ``raytrain pack`` at ``path``, or None: not packed
    images (no manifest, or one of packed rows); ``pack_manifest``'s error when unfinished."""
    manifest = pack_manifest(fs, path)
    return manifest if manifest is not None and manifest.get("format") == "images" else None


def read_labels(uri: str, options: StorageSpec | None = None) -> dict[str, str]:
    """A labels file (``SourceSpec.labels``): CSV with a ``path`` column (each image's path
    under the folder) and a ``label`` column (a class name, or an integer class index). A
    file that is not such a CSV is a ``BadImages`` naming what is wrong."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from raytrain import storage

    fs, path = storage.filesystem(uri, options)
    try:
        with fs.open_input_stream(path) as handle:
            table = pacsv.read_csv(
                handle,
                convert_options=pacsv.ConvertOptions(
                    column_types={"path": pa.string(), "label": pa.string()}
                ),
            )
    except Exception as exc:
        raise BadImages(f"cannot read {uri} as CSV: {str(exc).splitlines()[0]}") from None
    absent = [c for c in ("path", "label") if c not in table.column_names]
    if absent:
        raise BadImages(
            f"{uri} has no {' or '.join(absent)} column (it has: "
            f"{', '.join(table.column_names)}); a labels file is CSV with a header "
            "`path,label`"
        )
    out: dict[str, str] = {}
    rows = zip(table.column("path").to_pylist(), table.column("label").to_pylist(), strict=True)
    for line, (name, label) in enumerate(rows, start=2):
        name, label = (name or "").strip(), (label or "").strip()
        if not name or not label:
            raise BadImages(f"{uri}, line {line}: no path or no label")
        if name in out:
            raise BadImages(f"{uri}, line {line}: {name!r} is labelled twice")
        out[name] = label
    return out


def _labelled(
    files: list[str], root: str, labels: dict[str, str], uri: str
) -> tuple[list[int], tuple[str, ...]]:
    """Each file's class index from a labels file, and the class names (none where the
    labels are integers: they are the indices)."""
    rel = [f[len(root) + 1 :] for f in files]
    missing = [f for f, r in zip(files, rel, strict=True) if r not in labels]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise BadImages(f"{missing[0]} has no label in the labels file{more}")
    values = [labels[r] for r in rel]
    if all(v.lstrip("-").isdigit() for v in values):
        negative = next((f for f, v in zip(files, values, strict=True) if int(v) < 0), None)
        if negative is not None:
            raise BadImages(
                f"{negative}'s label {labels[negative[len(root) + 1 :]]} is no "
                "class index: integer labels are 0 or more"
            )
        return [int(v) for v in values], ()
    classes = tuple(sorted(set(values)))
    index = {name: i for i, name in enumerate(classes)}
    return [index[v] for v in values], classes


def _readable(fs: FileSystem, files: list[str], bad: str) -> tuple[list[str], int]:
    """The files whose header Pillow reads (``header_problem``, in threads), and how many
    were left out (``bad: skip``); with ``bad: error`` the first that does not is a
    ``BadImages`` naming it."""
    with ThreadPoolExecutor(CHECK_THREADS) as pool:
        problems = list(pool.map(lambda f: header_problem(fs, f), files))
    broken = [(f, why) for f, why in zip(files, problems, strict=True) if why]
    if broken and bad == "error":
        first, why = broken[0]
        more = f" (and {len(broken) - 1} more)" if len(broken) > 1 else ""
        raise BadImages(
            f"{first} does not decode: {why}{more}; set data.bad_images: skip "
            "to train without such files"
        )
    gone = {f for f, _ in broken}
    return [f for f in files if f not in gone], len(broken)


def _by_class_folder(files: list[str], root: str, top: list[str]) -> tuple[list[str], list[int]]:
    """The files inside the class folders ``top`` of ``root``, and each one's class index
    (a file beside the folders has none: left out); a class folder without images is a
    ``BadImages`` naming it."""
    index = {name: i for i, name in enumerate(top)}
    indices: list[int] = []
    kept: list[str] = []
    for f in files:
        parts = f[len(root) + 1 :].split("/")
        if len(parts) > 1:  # a file beside the class folders has no class: left out
            kept.append(f)
            indices.append(index[parts[0]])
    empty = sorted(set(top) - {top[i] for i in indices})
    if empty:
        raise BadImages(
            f"the class folder {root}/{empty[0]} has no image files"
            + (f" (nor have {len(empty) - 1} more)" if len(empty) > 1 else "")
        )
    return kept, indices


def list_images(
    uri: str,
    fs: FileSystem,
    path: str,
    *,
    bad: str = "error",
    check: bool = True,
    labels: dict[str, str] | None = None,
) -> ImageSet:
    """The image files under ``path`` (the folder ``uri`` names), sorted, with their labels:
    from ``labels`` (``read_labels``: every image must have one) or the class folders.

    A class folder without images is a ``BadImages`` naming it, as is a folder with none at
    all. With ``check``, every file's header is read (``header_problem``, in threads): a
    file Pillow cannot read is a ``BadImages`` naming it (``bad: error``) or is left out and
    counted (``bad: skip``)."""
    import pyarrow.fs as pafs

    root = path.rstrip("/")
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    found = {
        i.path: i.size or 0 for i in infos if i.type == pafs.FileType.File and is_image(i.path)
    }
    files = sorted(found)
    top = image_classes(fs, root)
    if not files:
        raise BadImages(f"no image files ({', '.join(IMAGE_EXTENSIONS)}) under {uri}")
    files, skipped = _readable(fs, files, bad) if check else (files, 0)
    if labels is not None:
        given, classes = _labelled(files, root, labels, uri)
        return ImageSet(
            uri=uri,
            files=tuple(files),
            labels=tuple(given),
            classes=classes,
            skipped=skipped,
            sizes=tuple(found[f] for f in files),
        )
    if not top:
        return ImageSet(
            uri=uri,
            files=tuple(files),
            labels=None,
            skipped=skipped,
            sizes=tuple(found[f] for f in files),
        )
    kept, indices = _by_class_folder(files, root, top)
    return ImageSet(
        uri=uri,
        files=tuple(kept),
        labels=tuple(indices),
        classes=tuple(top),
        skipped=skipped,
        sizes=tuple(found[f] for f in kept),
    )
