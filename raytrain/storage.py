"""Storage URIs: local paths and object-store URIs become a pyarrow filesystem and a path.

Everything that reads or writes a user-given location goes through here, so no other module
branches on the URI scheme. Local paths are made absolute at the driver, because Ray workers
may run with another working directory.

- ``s3://bucket/key``: pyarrow's native S3 filesystem (the AWS C++ SDK; chosen over s3fs by
  measurement: ``docs/decisions/035-*``). The endpoint comes from ``storage.s3.endpoint_url`` or
  the standard ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``; the region from
  ``storage.s3.region``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, or the bucket itself.
- ``gs://bucket/key``: pyarrow's GCS filesystem; an emulator from ``storage.gcs.endpoint_url``
  or ``STORAGE_EMULATOR_HOST``.
- ``abfs://container/path`` or ``abfs://container@account.dfs.core.windows.net/path``
  (also ``abfss://``, ``az://``): pyarrow's Azure filesystem; the account from the URI,
  ``storage.azure.account_name`` or ``AZURE_STORAGE_ACCOUNT_NAME``; a non-Azure endpoint
  (Azurite) from ``storage.azure.endpoint_url`` or ``AZURE_STORAGE_CONNECTION_STRING``.

Credentials come only from each provider's standard chain (environment, profiles, instance
roles, web identity); none is ever taken from a spec, and a filesystem built from a chain
pickles without them (Ray ships filesystems to its workers by pickling). Requests that meet a
transient fault (connection reset, 5xx, throttling) are retried with exponential backoff,
``storage.max_attempts`` times; permanent ones (403, 404) fail at once.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import posixpath
import re
import stat
import uuid
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import pyarrow.fs as pafs

from raytrain.errors import RecordUnreadable, StorageError, one_line

if TYPE_CHECKING:
    from raytrain.spec import StorageSpec

S3_SCHEMES = ("s3", "s3a")
GCS_SCHEMES = ("gs", "gcs")
AZURE_SCHEMES = ("abfs", "abfss", "az")
# A connection that cannot be made in this time counts as a failed attempt.
CONNECT_TIMEOUT_S = 5.0
GCS_SECONDS_PER_ATTEMPT = 3.0
# The largest record ``read_text`` reads: far above any raytrain writes (a snapshot of
# thousands of checkpoints is a few MB), and a bound on what a damaged or hostile one costs.
RECORD_MAX_BYTES = 64 * 1024 * 1024
# Attempts per request where no spec says (``storage.max_attempts``'s default). Nothing
# here imports the spec at run time: the spec imports this module to check its locations.
DEFAULT_ATTEMPTS = 3


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


def filesystem(location: str, options: StorageSpec | None = None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem holding ``location`` and the path within it."""
    location = resolve(location)
    if not is_uri(location):
        return pafs.LocalFileSystem(), location
    parsed = urlparse(location)
    scheme, key = parsed.scheme.lower(), parsed.path.lstrip("/")
    try:
        if scheme in S3_SCHEMES:
            fs, root = _s3(parsed.netloc, *_s3_settings(options)), parsed.netloc
        elif scheme in GCS_SCHEMES:
            fs, root = _gcs(*_gcs_settings(options)), parsed.netloc
        elif scheme in AZURE_SCHEMES:
            container, _, host = parsed.netloc.partition("@")
            fs, root = _azure(*_azure_settings(options, host)), container
        else:
            return pafs.FileSystem.from_uri(location)
    except StorageError:
        raise
    except Exception as exc:
        raise StorageError(f"{location}: cannot open this storage: {describe(exc)}") from None
    return fs, posixpath.join(root, key) if key else root


# Each store's settings: the spec's (None: no spec, its defaults), else the provider's
# standard variables. They are read
# on every call (tests and pipelines change the environment) and key the cache of built
# filesystems, so one filesystem per store and settings is built and reused.


def _attempts(opts: StorageSpec | None) -> int:
    return opts.max_attempts if opts is not None else DEFAULT_ATTEMPTS


def _s3_settings(opts: StorageSpec | None) -> tuple[int, str | None, str | None]:
    env = os.environ.get
    s3 = opts.s3 if opts is not None else None
    endpoint = (s3 and s3.endpoint_url) or env("AWS_ENDPOINT_URL_S3") or env("AWS_ENDPOINT_URL")
    region = (s3 and s3.region) or env("AWS_REGION") or env("AWS_DEFAULT_REGION")
    return _attempts(opts), endpoint or None, region or None


@functools.lru_cache(maxsize=32)
def _s3(bucket: str, attempts: int, endpoint: str | None, region: str | None) -> pafs.FileSystem:
    if region is None and endpoint is None:
        region = pafs.resolve_s3_region(bucket)  # a missing bucket fails here, clearly
    return pafs.S3FileSystem(
        region=region or "us-east-1",
        endpoint_override=endpoint,
        connect_timeout=CONNECT_TIMEOUT_S,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=attempts),
    )


def _gcs_settings(opts: StorageSpec | None) -> tuple[int, str | None, str | None, bool]:
    gcs = opts.gcs if opts is not None else None
    endpoint = (gcs and gcs.endpoint_url) or os.environ.get("STORAGE_EMULATOR_HOST") or None
    # An emulator takes no credentials; a private endpoint uses the standard chain.
    anonymous = endpoint is not None and not os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    return _attempts(opts), endpoint, gcs.project_id if gcs else None, anonymous


@functools.lru_cache(maxsize=8)
def _gcs(
    attempts: int, endpoint: str | None, project: str | None, anonymous: bool
) -> pafs.FileSystem:
    kwargs: dict = {
        # GCS retries transient faults for a time, not a count; it may overrun it up to 2x.
        "retry_time_limit": datetime.timedelta(seconds=attempts * GCS_SECONDS_PER_ATTEMPT),
        "project_id": project,
    }
    if endpoint:
        parsed = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
        kwargs.update(endpoint_override=parsed.netloc, scheme=parsed.scheme, anonymous=anonymous)
    return pafs.GcsFileSystem(**{k: v for k, v in kwargs.items() if v is not None})


def _azure_settings(opts: StorageSpec | None, host: str) -> tuple[str, str | None, str | None]:
    env = os.environ.get
    azure = opts.azure if opts is not None else None
    conn = _connection_string(env("AZURE_STORAGE_CONNECTION_STRING"))
    uri_account = host.split(".", 1)[0] if host.endswith(".core.windows.net") else None
    account = (
        uri_account
        or (azure and azure.account_name)
        or env("AZURE_STORAGE_ACCOUNT_NAME")
        or conn.get("AccountName")
    )
    if not account:
        raise StorageError(
            "abfs:// needs a storage account: abfs://container@ACCOUNT.dfs.core.windows.net/"
            "path, storage.azure.account_name, or AZURE_STORAGE_ACCOUNT_NAME"
        )
    key = env("AZURE_STORAGE_ACCOUNT_KEY") or env("AZURE_STORAGE_KEY") or conn.get("AccountKey")
    endpoint = (azure and azure.endpoint_url) or conn.get("BlobEndpoint")
    return account, key or None, endpoint or None


@functools.lru_cache(maxsize=8)
def _azure(account: str, key: str | None, endpoint: str | None) -> pafs.FileSystem:
    kwargs: dict = {"account_name": account, "account_key": key}
    if endpoint and urlparse(endpoint).scheme == "http" and not key:
        # pyarrow's Azure client aborts the whole process on a token over plain http.
        raise StorageError(
            f"abfs:// at {endpoint}: a plain-http endpoint (an emulator) needs a shared key "
            "(AZURE_STORAGE_ACCOUNT_KEY or the AccountKey of AZURE_STORAGE_CONNECTION_STRING)"
        )
    if endpoint:
        parsed = urlparse(endpoint)
        for service in ("blob", "dfs"):
            kwargs[f"{service}_storage_authority"] = parsed.netloc
            kwargs[f"{service}_storage_scheme"] = parsed.scheme
    return pafs.AzureFileSystem(**{k: v for k, v in kwargs.items() if v is not None})


def _connection_string(text: str | None) -> dict[str, str]:
    """``AZURE_STORAGE_CONNECTION_STRING`` (``Key=Value;...``) as a mapping."""
    pairs = (item.partition("=") for item in (text or "").split(";") if "=" in item)
    return {key.strip(): value.strip() for key, _, value in pairs}


_DENIED = "access denied (no permission)"
# What the stores' error texts mean, for messages that say the cause: (markers, cause).
_CAUSES = (
    (
        (
            "INVALID_ACCESS_KEY_ID",
            "SIGNATURE_DOES_NOT_MATCH",
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "AuthenticationFailed",
            "InvalidToken",
            "EXPIRED_TOKEN",
            "ExpiredToken",
            "Unauthorized",
            401,
        ),
        "the credentials were rejected",
    ),
    (
        (
            "ACCESS_DENIED",
            "AccessDenied",
            "AuthorizationPermissionMismatch",
            "AuthorizationFailure",
            "Forbidden",
            403,
        ),
        _DENIED,
    ),
    (
        (
            "NETWORK_CONNECTION",
            "Could not connect",
            "Couldn't connect",
            "Connection refused",
            "curlCode: 7",
            "curlCode: 28",
            "timed out",
            "Timeout",
            "Could not resolve",
            "Failed to connect",
        ),
        "the endpoint cannot be reached",
    ),
    (
        ("NO_SUCH_BUCKET", "NoSuchBucket", "ContainerNotFound", "bucket does not exist"),
        "the bucket does not exist",
    ),
)


def cause(exc: BaseException) -> str | None:
    """What a storage error means (missing bucket, rejected credentials ...), if known.

    A marker that is a number (an HTTP status) matches only as a number of its own: the
    port in "Failed to connect to 127.0.0.1 port 40111" is no 401."""
    text = str(exc)
    numbers = set(re.findall(r"\d+", text))
    for markers, meaning in _CAUSES:
        if any(str(m) in numbers if isinstance(m, int) else m in text for m in markers):
            return meaning
    return None


def describe(exc: BaseException) -> str:
    """A storage error as one line: its cause, if known, and the store's own words."""
    detail = one_line(exc)
    meaning = cause(exc)
    return f"{meaning} ({detail})" if meaning else detail


def join(location: str, *parts: str) -> str:
    """``location`` with path parts appended, keeping a URI a URI."""
    if is_uri(location):
        return posixpath.join(location.rstrip("/"), *parts)
    return os.path.join(location, *parts)


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


def missing_bucket(location: str, options: StorageSpec | None = None) -> str | None:
    """The name of ``location``'s bucket (container) if it does not exist, else None."""
    if not is_uri(location):
        return None
    fs, path = filesystem(location, options)
    bucket = path.split("/", 1)[0]
    try:
        found = fs.get_file_info(bucket).type != pafs.FileType.NotFound
    except OSError as exc:
        if cause(exc) != _DENIED:
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
