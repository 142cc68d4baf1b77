"""Storage: local paths and object-store URIs, the pyarrow filesystems that hold them, and the
files at them.

Everything that reads or writes a user-given location goes through this package, so no other
module branches on the URI scheme.

- ``locations``: a path or a URI told apart, checked, made absolute, joined (nothing of
  ``raytrain.spec``, which imports it to check its locations);
- ``filesystems``: the pyarrow filesystem for a location (S3, GCS, Azure, local) and the
  settings each store takes;
- ``causes``: what a store's error means;
- ``files``: existence, listing, the bounded record reader, the atomic writer, deletion;
- ``write_checks``: before any work, whether an output file or a run's storage can be
  written.
"""

from raytrain.storage.causes import cause, describe
from raytrain.storage.files import (
    RECORD_MAX_BYTES,
    delete_dir,
    delete_file,
    exists,
    list_dir,
    read_text,
    write_text,
)
from raytrain.storage.filesystems import (
    CONNECT_TIMEOUT_S,
    DEFAULT_ATTEMPTS,
    GCS_SECONDS_PER_ATTEMPT,
    filesystem,
)
from raytrain.storage.locations import (
    AZURE_SCHEMES,
    GCS_SCHEMES,
    S3_SCHEMES,
    is_relative_path,
    is_uri,
    join,
    local_path,
    location_problem,
    resolve,
)
from raytrain.storage.write_checks import check_writable, missing_bucket, output_file

__all__ = [
    "AZURE_SCHEMES",
    "CONNECT_TIMEOUT_S",
    "DEFAULT_ATTEMPTS",
    "GCS_SCHEMES",
    "GCS_SECONDS_PER_ATTEMPT",
    "RECORD_MAX_BYTES",
    "S3_SCHEMES",
    "cause",
    "check_writable",
    "delete_dir",
    "delete_file",
    "describe",
    "exists",
    "filesystem",
    "is_relative_path",
    "is_uri",
    "join",
    "list_dir",
    "local_path",
    "location_problem",
    "missing_bucket",
    "output_file",
    "read_text",
    "resolve",
    "write_text",
]
