"""Storage URIs: local paths and object-store URIs become a pyarrow filesystem and a path.

Everything that reads or writes a user-given location goes through here, so no other module
branches on the URI scheme. Local paths are made absolute at the driver, because Ray workers
may run with another working directory.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from urllib.parse import urlparse

import pyarrow.fs as pafs

from raytrain.errors import StorageError


def is_uri(location: str) -> bool:
    """Whether ``location`` names a remote store (``s3://``, ``gs://`` ...) and not a path."""
    scheme = urlparse(location).scheme
    return len(scheme) > 1 and scheme != "file"


def resolve(location: str) -> str:
    """An absolute local path, or the URI unchanged; ``file://`` URIs become paths."""
    if is_uri(location):
        return location.rstrip("/") if location.count("/") > 2 else location
    if location.startswith("file://"):
        location = urlparse(location).path
    return os.path.abspath(os.path.expanduser(location))


def filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem holding ``location`` and the path within it."""
    location = resolve(location)
    if not is_uri(location):
        return pafs.LocalFileSystem(), location
    try:
        return pafs.FileSystem.from_uri(location)
    except Exception as exc:
        raise StorageError(f"{location}: cannot open this storage ({exc})") from None


def join(location: str, *parts: str) -> str:
    """``location`` with path parts appended, keeping a URI a URI."""
    if is_uri(location):
        return posixpath.join(location.rstrip("/"), *parts)
    return os.path.join(location, *parts)


def exists(location: str) -> bool:
    """Whether a file or folder exists at ``location``."""
    fs, path = filesystem(location)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_text(location: str) -> str | None:
    """The text of the file at ``location``, or None when there is none."""
    fs, path = filesystem(location)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with fs.open_input_stream(path) as stream:
        return stream.read().decode("utf-8")


def write_text(location: str, text: str) -> None:
    """Write ``text`` to ``location`` so readers see the old file or the new one, never half.

    Locally the file is written beside its target and renamed over it; object stores commit a
    single PUT atomically already.
    """
    fs, path = filesystem(location)
    fs.create_dir(posixpath.dirname(path) if is_uri(location) else os.path.dirname(path))
    if is_uri(location):
        with fs.open_output_stream(path) as stream:
            stream.write(text.encode("utf-8"))
        return
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


def delete_dir(location: str) -> None:
    """Remove the folder at ``location`` and all it holds, if it exists."""
    fs, path = filesystem(location)
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_dir(path)
