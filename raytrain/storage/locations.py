"""Storage locations: a local path or an object-store URI, told apart, checked, resolved and
joined. Nothing here imports ``raytrain.spec``: the spec imports it to check its locations.

Local paths are made absolute at the driver, because Ray workers may run with another working
directory. A URI names a store by its scheme: ``s3://`` (``s3a://``), ``gs://`` (``gcs://``),
``abfs://`` (``abfss://``, ``az://``); ``raytrain.storage.filesystems`` opens each.
"""

from __future__ import annotations

import os
import posixpath
from urllib.parse import urlparse

from raytrain.errors import StorageError

S3_SCHEMES = ("s3", "s3a")
GCS_SCHEMES = ("gs", "gcs")
AZURE_SCHEMES = ("abfs", "abfss", "az")


def is_uri(location: str) -> bool:
    """Whether ``location`` names a remote store (``s3://``, ``gs://`` ...) and not a path."""
    scheme = urlparse(location).scheme
    return len(scheme) > 1 and scheme != "file"


def is_relative_path(location: str) -> bool:
    """Whether ``location`` is a relative local path (a URI, ``file://`` too, never is)."""
    return "://" not in location and not os.path.isabs(location)


def location_problem(location: str) -> str | None:
    """Why ``location`` cannot name a store, or None. ``file://runs`` is not the folder
    ``runs``: ``runs`` is the URI's host and its path is empty, so a ``file://`` URI with a
    host (but ``localhost``) is refused, not read as some other folder. A URI never carries
    credentials (``s3://user:secret@bucket``): they come from the provider's chain; Azure's
    ``abfs://container@account...`` names a container, not a user."""
    parsed = urlparse(location)
    scheme = parsed.scheme.lower()
    if scheme == "file" and parsed.netloc not in ("", "localhost"):
        return (
            f"a file:// URI with a host part ({parsed.netloc!r}) is not a local path: "
            "use file:///absolute/path or a plain path"
        )
    user, at, _ = parsed.netloc.rpartition("@")
    if at and (scheme not in AZURE_SCHEMES or ":" in user):
        return (
            "credentials do not belong in the spec, nor in a storage URI: they come from "
            "the provider's standard variables, profiles or instance roles"
        )
    return None


def resolve(location: str) -> str:
    """An absolute local path, or the URI unchanged; ``file://`` URIs become paths. A
    location with a ``location_problem`` is a ``StorageError``."""
    problem = location_problem(location)
    if problem is not None:
        raise StorageError(f"{location}: {problem}")  # errors mask the URI themselves
    if is_uri(location):
        return location.rstrip("/") if location.count("/") > 2 else location
    return local_path(location)


def local_path(location: str) -> str:
    """The absolute path a local ``location`` names: a path (``~`` expanded) or a ``file:``
    URI."""
    if location[:5].lower() == "file:":
        location = urlparse(location).path
    return os.path.abspath(os.path.expanduser(location))


def join(location: str, *parts: str) -> str:
    """``location`` with path parts appended, keeping a URI a URI."""
    if is_uri(location):
        return posixpath.join(location.rstrip("/"), *parts)
    return os.path.join(location, *parts)
