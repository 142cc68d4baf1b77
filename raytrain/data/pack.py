"""``raytrain pack``: a set of many small files rewritten as Parquet shards, once.

An image folder in object storage costs one GET per image every epoch: for ImageNet's 1.2
million objects the requests, not the bytes, bound the reading (what WebDataset, MosaicML
Streaming's MDS and LitData's ``optimize`` answer the same way). ``pack`` reads the files
once and writes them as Parquet shards of about ``shard_mb`` MB: an image folder as rows of
the file's encoded bytes (``image``), its class index (``label``, when it has class
folders) and its path; CSV and JSON Lines as their rows, in the types every block of them
parses into (``text_blocks``). A spec then reads the packed folder at Parquet's speed, as
exact as any streamed set: ``format: images`` for packed images (decoded by each rank's
decoding processes, as a folder's files are), ``format: parquet`` for packed rows.

The shards follow from the sorted listing and ``shard_mb`` alone (``plan_shards``), so an
interrupted pack run again plans the same shards and skips those already written whole
(their footer holds the same files, ``PLAN_KEY``). A shard is written in one piece: built
in memory, then a local file renamed into place, or one upload an object store completes
only at its end, so a killed pack leaves whole shards or none. The manifest
(``MANIFEST``, ignored by Parquet readers for its leading underscore) is written last.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from raytrain.data.image_files import PACK_MANIFEST

if TYPE_CHECKING:
    import pyarrow as pa
    from pyarrow.fs import FileSystem

    from raytrain.spec import StorageSpec

MANIFEST = PACK_MANIFEST
PLAN_KEY = b"raytrain.pack.plan"  # a shard's footer: the hash of the files it holds
KIND_KEY = b"raytrain.packed"  # a shard's footer: images, csv or json
ROW_GROUP_BYTES = 16 * 2**20  # about this much per row group: a window of the stream
FETCH_THREADS = 32  # reads in flight while a shard is gathered (many small objects)


class PackError(ValueError):
    """Bad input to ``pack``: a source that cannot be packed or, with ``dest``, a
    destination that cannot take the shards; the CLI names the one it is about."""

    def __init__(self, message: str, *, dest: bool = False):
        super().__init__(message)
        self.dest = dest


def plan_shards(sizes: Sequence[int], shard_bytes: int) -> list[range]:
    """Consecutive runs of the items (by their ``sizes``) for the shards.

    Invariant: the runs are consecutive, none empty, and together are every item in order;
    each but the last holds at least ``shard_bytes`` and would hold less without its last
    item. So the plan depends on the sizes and ``shard_bytes`` only."""
    runs: list[range] = []
    start, held = 0, 0
    for i, size in enumerate(sizes):
        held += size
        if held >= shard_bytes:
            runs.append(range(start, i + 1))
            start, held = i + 1, 0
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs


@dataclass(frozen=True)
class PackSummary:
    """What a pack did: the source's files and bytes, the shards, those already there."""

    files: int
    bytes: int
    shards: int
    skipped: int  # shards already written whole by an earlier, interrupted pack
    rows: int
    seconds: float
    dest: str
    bad_files: int = 0  # images left out as undecodable (``skip_bad``)


def shard_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


def pack(
    src: str,
    dest: str,
    fmt: str = "images",
    shard_mb: float = 256,
    options: StorageSpec | None = None,
    out: TextIO = sys.stderr,
    skip_bad: bool = False,
) -> PackSummary:
    """Pack the files under ``src`` (format ``fmt``) into Parquet shards under ``dest`` (see
    the module docstring); progress lines go to ``out``. A source that cannot be packed is
    a ``PackError`` naming it; a file that does not decode (images) or parse (CSV, JSON)
    too, with the shards before it kept (``skip_bad``: images that do not decode are left
    out and counted instead)."""

    from raytrain import storage

    began = time.monotonic()
    if not math.isfinite(shard_mb) or shard_mb <= 0:
        raise PackError(f"--shard-mb {shard_mb:g}: a size in MB, more than 0")
    src_fs, src_path = storage.filesystem(src, options)
    dest_fs, dest_path = storage.filesystem(dest, options)
    source = _source(src, src_fs, src_path, fmt, skip_bad)
    sizes = source.sizes
    plan = plan_shards(sizes, max(1, int(min(shard_mb, 2**40) * 2**20)))
    manifest_uri = f"{dest.rstrip('/')}/{MANIFEST}"
    _claim(dest_fs, dest_path)
    # unfinished until the end: a reader refuses the folder meanwhile, a rerun may go on
    storage.write_text(
        manifest_uri, json.dumps({"format": fmt, "source": src, "complete": False}), options
    )
    skipped, rows = _write_shards(source, fmt, plan, dest_fs, dest_path, out)
    _remove_stale(dest_fs, dest_path, len(plan))
    summary = PackSummary(
        files=source.files,
        bytes=sum(sizes),
        shards=len(plan),
        skipped=skipped,
        rows=rows,
        seconds=time.monotonic() - began,
        dest=dest,
        bad_files=source.bad[0],
    )
    manifest = {
        "format": fmt,
        "source": src,
        "complete": True,
        "files": summary.files,
        "bytes": summary.bytes,
        "rows": rows,
        "skipped_files": source.bad[0],
        "shards": [shard_name(i) for i in range(len(plan))],
        "shard_mb": shard_mb,
        **source.manifest,
    }
    storage.write_text(manifest_uri, json.dumps(manifest, indent=1), options)
    return summary


def _source(src: str, fs: FileSystem, path: str, fmt: str, skip_bad: bool) -> Any:
    """What is packed from ``src``, by its format: its units (files or blocks), their sizes
    and stamps, and how to write a shard of them."""
    import pyarrow.fs as pafs

    if fmt == "images":
        if fs.get_file_info(path).type == pafs.FileType.File:
            raise PackError(f"{src} is a file: pack a folder of images")
        return _image_source(src, fs, path, skip_bad)
    if fmt in ("csv", "json"):
        return _text_source(src, fs, path, fmt)
    raise PackError(f"--format {fmt}: images, csv or json")


def _write_shards(
    source: Any, fmt: str, plan: list[range], fs: FileSystem, path: str, out: TextIO
) -> tuple[int, int]:
    """Every shard of ``plan`` not already whole under ``path`` (a rerun's), written and put
    in place, a line each on ``out``: (shards skipped, rows in all the shards)."""
    units, sizes = source.units, source.sizes
    skipped, rows = 0, 0
    for index, run in enumerate(plan):
        where = f"{path.rstrip('/')}/{shard_name(index)}"
        key = _plan_key(fmt, [units[i] for i in run], [sizes[i] for i in run], source.stamps)
        held = _whole_shard(fs, where, key)
        if held is not None:
            skipped, rows = skipped + 1, rows + held
            print(
                f"raytrain pack: shard {index + 1}/{len(plan)} already packed", file=out, flush=True
            )
            continue
        began = time.monotonic()
        data, count = source.write(list(run), {PLAN_KEY: key, KIND_KEY: fmt.encode()})
        _put(fs, where, data)
        rows += count
        unit, megabytes = "files" if fmt == "images" else "blocks", sum(sizes[i] for i in run) / 1e6
        print(
            f"raytrain pack: shard {index + 1}/{len(plan)}: {len(run):,} {unit}, "
            f"{megabytes:,.1f} MB ({time.monotonic() - began:.1f} s)",
            file=out,
            flush=True,
        )
    return skipped, rows


def _claim(fs: FileSystem, path: str) -> None:
    """Make ``path`` a pack's folder: new, empty, or a pack's already (a manifest, finished
    or not). Anything else is refused: the shards' clean-up would delete files it did not
    write, and a reader would take them as part of the set."""
    import pyarrow.fs as pafs

    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        raise PackError("a file: name a folder for the shards", dest=True)
    if info.type == pafs.FileType.Directory:
        names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(path))}
        if names and MANIFEST not in names:
            raise PackError(
                f"holds other files ({', '.join(sorted(names)[:3])}"
                f"{', ...' if len(names) > 3 else ''}) and no pack's "
                f"{MANIFEST}: pack into a new or empty folder",
                dest=True,
            )
    fs.create_dir(path, recursive=True)


@dataclass(frozen=True)
class PackSource:
    """What is packed: its units (image files, or blocks of lines) in order, their bytes,
    the writer of a shard of them (unit indices, footer metadata -> Parquet bytes, rows),
    the source's files, and what the manifest adds (an image folder's classes)."""

    units: list[Any]  # image file paths, or (CSV/JSON file path, block index)
    sizes: list[int]
    write: Callable[[list[int], dict[bytes, bytes]], tuple[bytes, int]]
    files: int
    manifest: dict[str, Any]
    stamps: dict[str, Any]  # each file's modification time (ns), from its listing
    bad: list[int]  # [images left out as undecodable] (a counter the writer updates)


def _plan_key(
    fmt: str, units: Sequence[Any], sizes: Sequence[int], stamps: dict[str, Any]
) -> bytes:
    """A shard's identity: its units and their bytes, and its files' paths and modification
    times (``stamps``), so a rerun over a changed source writes the shard again."""
    files = sorted({u if isinstance(u, str) else u[0] for u in units})
    digest = hashlib.sha256(
        json.dumps([fmt, list(units), list(sizes), [(f, stamps.get(f)) for f in files]]).encode()
    )
    return digest.hexdigest().encode()


def _whole_shard(fs: FileSystem, path: str, key: bytes) -> int | None:
    """The rows of the shard at ``path`` when it was written whole from the same files
    (its footer's ``PLAN_KEY``), else None."""
    import pyarrow.parquet as pq

    try:
        with fs.open_input_file(path) as handle:
            meta = pq.ParquetFile(handle).metadata
    except Exception:
        return None
    if (meta.metadata or {}).get(PLAN_KEY) != key:
        return None
    return int(meta.num_rows)


def _put(fs: FileSystem, path: str, data: bytes) -> None:
    """Write a shard in one piece: locally a temporary file renamed into place; on an object
    store one upload, which the store completes only once it is whole."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):
        tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.tmp"
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        return
    with fs.open_output_stream(path) as handle:
        handle.write(data)


def _remove_stale(fs: FileSystem, dest_path: str, shards: int) -> None:
    """Shards past the plan's (a pack of the same folder with a smaller set or larger shards
    before): a reader would take them as part of the set."""
    import pyarrow.fs as pafs

    for info in fs.get_file_info(pafs.FileSelector(dest_path)):
        name = info.base_name
        if name.startswith("part-") and name.endswith(".parquet"):
            number = name[len("part-") : -len(".parquet")]
            if number.isdigit() and int(number) >= shards:
                fs.delete_file(info.path)


def _parquet(table: pa.Table, metadata: dict[bytes, bytes], row_bytes: float) -> bytes:
    """``table`` as one Parquet file in memory, row groups of about ``ROW_GROUP_BYTES``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    sink = pa.BufferOutputStream()
    rows = max(1, int(ROW_GROUP_BYTES / max(row_bytes, 1)))
    pq.write_table(table, sink, row_group_size=rows)
    return sink.getvalue().to_pybytes()


def _stamps(fs: FileSystem, path: str) -> dict[str, Any]:
    """Every file's modification time under ``path`` (ns; None where the store has none)."""
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(path.rstrip("/"), recursive=True))
    return {i.path: i.mtime_ns for i in infos if i.type == pafs.FileType.File}


def _image_source(src: str, fs: FileSystem, path: str, skip_bad: bool) -> PackSource:
    """An image folder's files, each a unit. Each is decoded whole as it is packed (a
    truncated file passes a header check): one that does not decode is a ``PackError``
    naming it, or with ``skip_bad`` left out of its shard and counted."""
    import pyarrow as pa

    from raytrain.data.image_files import BadImages, image_problem, list_images

    try:
        images = list_images(src, fs, path, check=False)
    except BadImages as exc:
        raise PackError(str(exc)) from None
    root = path.rstrip("/") + "/"
    bad = [0]

    def read(i: int) -> bytes:
        with fs.open_input_stream(images.files[i]) as handle:
            return bytes(handle.read())

    def write(run: list[int], metadata: dict[bytes, bytes]) -> tuple[bytes, int]:
        with ThreadPoolExecutor(FETCH_THREADS) as pool:
            datas = list(pool.map(read, run))
        kept, kept_data = [], []
        for i, data in zip(run, datas, strict=True):
            why = image_problem(data, whole=True)
            if why is None:
                kept.append(i)
                kept_data.append(data)
            elif skip_bad:
                bad[0] += 1
            else:
                raise PackError(
                    f"{images.files[i]} does not decode: {why} (--skip-bad packs "
                    "without such files)"
                )
        columns = {
            "image": pa.array(kept_data, pa.binary()),
            "path": pa.array([images.files[i].removeprefix(root) for i in kept], pa.string()),
        }
        if images.labels is not None:
            columns["label"] = pa.array([images.labels[i] for i in kept], pa.int64())
        table = pa.table(columns)
        extra = {b"raytrain.classes": json.dumps(list(images.classes)).encode()}
        mean = sum(map(len, kept_data)) / max(len(kept_data), 1)
        return _parquet(table, {**metadata, **extra}, mean), len(kept)

    return PackSource(
        list(images.files),
        list(images.sizes),
        write,
        images.num_rows,
        {"classes": list(images.classes)},
        _stamps(fs, path),
        bad,
    )


def _text_source(src: str, fs: FileSystem, path: str, fmt: str) -> PackSource:
    """A CSV or JSON set's blocks of lines, each a unit."""
    import pyarrow as pa

    from raytrain.data.text_blocks import BadRows, plan_text, read_block

    try:
        found = plan_text(src, fs, path, fmt)
    except BadRows as exc:
        raise PackError(str(exc)) from None
    units = [(found.files[f], u) for f, u, _ in found.row_groups]
    index = {name: f for f, name in enumerate(found.files)}

    def write(run: list[int], metadata: dict[bytes, bytes]) -> tuple[bytes, int]:
        tables = []
        for i in run:
            name, u = units[i]
            with fs.open_input_file(name) as handle:
                tables.append(read_block(found, u, None, handle))
        table = pa.concat_tables(tables)
        nbytes = sum(found.blocks[units[i][1]][1] for i in run)
        return _parquet(table, metadata, nbytes / max(table.num_rows, 1)), table.num_rows

    stamps = {name: stamp for name, stamp in _stamps(fs, path).items() if name in index}
    if not stamps and found.files:  # a single file
        stamps = {found.files[0]: fs.get_file_info(found.files[0]).mtime_ns}
    return PackSource(
        units, [found.blocks[u][1] for _, u in units], write, len(found.files), {}, stamps, [0]
    )
