"""Checks before any work that a location can be written: a command's local output file
(``output_file``), a store's bucket (``missing_bucket``), and a run's storage, probed by a
small file written and deleted (``check_writable``).
"""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING

import pyarrow.fs as pafs

from raytrain.errors import StorageError
from raytrain.storage.causes import DENIED, cause, describe
from raytrain.storage.files import delete_file, list_dir, write_text
from raytrain.storage.filesystems import filesystem
from raytrain.storage.locations import is_uri, join

if TYPE_CHECKING:
    from raytrain.spec import StorageSpec


def output_file(out: str, label: str | None = None) -> str:
    """``out``, a local file a command is to write, as an absolute path: checked before any
    work, and refused (a ``StorageError`` starting with ``label``, default ``out``) when it
    is a folder, under something that is not a folder, not a regular file (a FIFO, a
    device: a rename would replace it), or where this process may not write. Nothing is
    written; missing folders on its way may be made by the writer."""
    label = label or out
    path = os.path.abspath(os.path.expanduser(out))
    if os.path.isdir(path) or out.endswith(("/", os.sep)):
        raise StorageError(f"{label}: is a folder; name the file to write in it")
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise StorageError(f"{label}: {parent} is a file, not a folder")
    if os.path.lexists(path) and not os.path.islink(path) and not os.path.isfile(path):
        raise StorageError(f"{label}: is not a regular file; name the file to write")
    denied = [
        p
        for p, mode in ((parent, os.W_OK | os.X_OK), (path, os.W_OK))
        if os.path.exists(p) and not os.access(p, mode)
    ]
    if denied:
        raise StorageError(f"{label}: no permission to write {denied[0]}")
    return path


def missing_bucket(location: str, options: StorageSpec | None = None) -> str | None:
    """The name of ``location``'s bucket (container) if it does not exist, else None."""
    if not is_uri(location):
        return None
    fs, path = filesystem(location, options)
    bucket = path.split("/", 1)[0]
    try:
        found = fs.get_file_info(bucket).type != pafs.FileType.NotFound
    except OSError as exc:
        if cause(exc) != DENIED:
            raise
        found = True  # a user may be allowed into a bucket without HeadBucket
    return None if found else bucket


def check_writable(location: str, options: StorageSpec | None = None) -> str | None:
    """Why ``location`` cannot hold a run (write and delete a small probe file), or None.

    The cause names what is wrong: a missing bucket, rejected credentials, no permission, an
    endpoint that cannot be reached.
    """
    probe = join(location, f".raytrain-probe-{uuid.uuid4().hex}")
    try:
        # A listing tells rejected credentials from a missing key (a HEAD cannot).
        bucket = not list_dir(location, options) and missing_bucket(location, options)
        if bucket:
            return f"the bucket {bucket!r} does not exist"
    except Exception as exc:
        return f"cannot list it: {describe(exc)}"
    try:
        write_text(probe, "probe", options)
    except Exception as exc:
        return f"cannot write: {describe(exc)}"
    try:
        delete_file(probe, options)
    except Exception as exc:
        return f"cannot delete (needed to drop old checkpoints): {describe(exc)}"
    return None
