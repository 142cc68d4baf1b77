"""Files at a storage location: whether one exists, a folder's listing, the one bounded
reader of raytrain's records (``read_text``), the atomic writer (``write_text``), deletion.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from typing import TYPE_CHECKING

import pyarrow.fs as pafs

from raytrain.errors import RecordUnreadable, StorageError
from raytrain.storage.causes import describe
from raytrain.storage.filesystems import filesystem
from raytrain.storage.locations import is_uri

if TYPE_CHECKING:
    from raytrain.spec import StorageSpec

# The largest record ``read_text`` reads: far above any raytrain writes (a snapshot of
# thousands of checkpoints is a few MB), and a bound on what a damaged or hostile one costs.
RECORD_MAX_BYTES = 64 * 1024 * 1024


def exists(location: str, options: StorageSpec | None = None) -> bool:
    """Whether a file or folder exists at ``location``."""
    fs, path = filesystem(location, options)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def list_dir(location: str, options: StorageSpec | None = None) -> list[pafs.FileInfo]:
    """What the folder at ``location`` holds directly; empty when it does not exist."""
    fs, path = filesystem(location, options)
    return fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))


def read_text(
    location: str, options: StorageSpec | None = None, max_bytes: int = RECORD_MAX_BYTES
) -> str | None:
    """The text of the file at ``location``, or None when there is none: the one reader of
    raytrain's records (run state, status record, lease, Ray's snapshot, a sweep's record,
    a hang's stacks), which may have been edited, damaged or replaced.

    Whatever is there, the read is bounded and ends: a folder, a FIFO, a socket or a device
    (a link to ``/dev/zero``) is refused by its type before it is opened; a file is read up
    to ``max_bytes`` + 1 bytes, and one larger is refused. Each is a ``StorageError`` naming
    ``location``, and so is a store's failure (unreachable, denied); bytes that cannot be a
    record (larger, or not UTF-8) are a ``RecordUnreadable``, a ``ValueError`` as well, which
    a reader that handles a damaged record handles."""
    fs, path = filesystem(location, options)
    try:
        if isinstance(fs, pafs.LocalFileSystem):
            data = _read_local(location, path, max_bytes)
        else:
            data = _read_stored(location, fs, path, max_bytes)
    except OSError as exc:
        raise StorageError(f"{location}: cannot read it: {describe(exc)}") from None
    if data is None:
        return None
    if len(data) > max_bytes:
        raise _too_large(location, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordUnreadable(f"{location}: not UTF-8 text (byte {exc.start} is not)") from None


def _read_local(location: str, path: str, limit: int) -> bytes | None:
    """At most ``limit`` + 1 bytes of the regular file at ``path``; None when there is
    none. Its type is checked before it is opened (a FIFO's open would wait for a writer),
    and again on what was opened, in case it was swapped in between."""
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    _regular(location, info.st_mode)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    with open(os.open(path, flags), "rb") as handle:
        _regular(location, os.fstat(handle.fileno()).st_mode)
        return handle.read(limit + 1)


def _regular(location: str, mode: int) -> None:
    """Refuse anything but a regular file, naming what it is."""
    if stat.S_ISREG(mode):
        return
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    )
    kind = next((name for test, name in kinds if test(mode)), "not a file")
    raise StorageError(f"{location}: is {kind}, not a regular file; a raytrain record is one")


def _too_large(location: str, limit: int) -> RecordUnreadable:
    return RecordUnreadable(
        f"{location}: larger than {limit:,} bytes, the limit of a raytrain record; it is not one"
    )


def _read_stored(location: str, fs: pafs.FileSystem, path: str, limit: int) -> bytes | None:
    """At most ``limit`` + 1 bytes of the object at ``path``; None when there is none."""
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        return None
    if info.type != pafs.FileType.File:
        raise StorageError(f"{location}: is a folder, not a file; a raytrain record is one")
    if info.size is not None and info.size > limit:
        raise _too_large(location, limit)  # without reading it
    with fs.open_input_stream(path) as stream:
        return stream.read(limit + 1)


def write_text(location: str, text: str, options: StorageSpec | None = None) -> None:
    """Write ``text`` to ``location`` so readers see the old file or the new one, never half.

    Locally the file is written beside its target and renamed over it; object stores commit a
    single PUT atomically already.
    """
    fs, path = filesystem(location, options)
    if is_uri(location):
        with fs.open_output_stream(path) as stream:
            stream.write(text.encode("utf-8"))
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


def delete_dir(location: str, options: StorageSpec | None = None) -> None:
    """Remove the folder at ``location`` and all it holds, if it exists."""
    fs, path = filesystem(location, options)
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        # GCS deletes the files, then fails on the folder marker a bare prefix lacks.
        with contextlib.suppress(FileNotFoundError):
            fs.delete_dir(path)


def delete_file(location: str, options: StorageSpec | None = None) -> None:
    """Remove the file at ``location``."""
    fs, path = filesystem(location, options)
    fs.delete_file(path)
