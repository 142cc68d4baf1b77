"""Storage filesystems: a location becomes the pyarrow filesystem holding it and the path
within it.

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

import datetime
import functools
import os
import posixpath
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import pyarrow.fs as pafs

from raytrain.errors import StorageError
from raytrain.storage.causes import describe
from raytrain.storage.locations import AZURE_SCHEMES, GCS_SCHEMES, S3_SCHEMES, is_uri, resolve

if TYPE_CHECKING:
    from raytrain.spec import StorageSpec

# A connection that cannot be made in this time counts as a failed attempt.
CONNECT_TIMEOUT_S = 5.0
GCS_SECONDS_PER_ATTEMPT = 3.0
# Attempts per request where no spec says (``storage.max_attempts``'s default). Nothing
# in this package imports the spec at run time: the spec imports this default, and
# ``locations`` to check its locations.
DEFAULT_ATTEMPTS = 3


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
