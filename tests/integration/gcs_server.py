"""A local Google Cloud Storage API server on loopback (gcp-storage-emulator), for the tests.

Install: ``pip install gcp-storage-emulator``. The emulator keeps everything in memory and
speaks the GCS JSON API, which pyarrow's ``GcsFileSystem`` uses::

    fs = pyarrow.fs.GcsFileSystem(
        anonymous=True, endpoint_override=endpoint.removeprefix("http://"), scheme="http"
    )
"""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.integration.servers import free_port, server_process

GCS_PROJECT = "test-project"

# gcp-storage-emulator, patched at start-up (``_LAUNCHER``) where it falls short of GCS for
# pyarrow's GcsFileSystem; the emulator package itself is left alone:
# * It serves one request at a time (http.server.HTTPServer). GcsFileSystem.open_input_file
#   starts a streaming read of the whole object and, on seek + read, opens a second ranged
#   request while the first is unread: with an object larger than the socket buffers (a few MB)
#   the server blocks writing the first body and never answers the second, and pyarrow waits
#   forever. So it runs threaded; handling stays serialised under one lock (the emulator's state
#   is not thread-safe), only the writing of response bodies runs in parallel.
# * It ignores ``includeTrailingDelimiter=true``, so a non-recursive FileSelector missed
#   directory markers ("dir/" objects, which create_dir makes).
# * It answers ``GET /storage/v1/b/BUCKET/o/`` (empty object name, which delete_dir("bucket")
#   and delete_dir_contents("bucket") send) with 501, which the client retries until its retry
#   time limit; GCS answers 404.
_LAUNCHER = """
import http.server, re, sys, threading
from http import HTTPStatus
from urllib.parse import urlparse
from gcp_storage_emulator import server as s
from gcp_storage_emulator.__main__ import main

class Threading(http.server.ThreadingHTTPServer):
    daemon_threads = True

s.server.HTTPServer = Threading
lock = threading.Lock()
close_response = s.Response.close
handle = s.Router.handle
apply_delimiter = s.Storage._apply_list_delimiter
trailing = False

def deferred_close(response):
    response._handler._pending_response = response

def locked_handle(router, method):
    global trailing
    url = urlparse(router._request_handler.path)
    with lock:
        trailing = "includeTrailingDelimiter=true" in url.query
        handle(router, method)
    response = router._request_handler.__dict__.pop("_pending_response", None)
    if response is None:
        return
    empty_name = re.fullmatch("/storage/v1/b/[^/]+/o/", url.path)
    if response.status == HTTPStatus.NOT_IMPLEMENTED and empty_name:
        response.status = HTTPStatus.NOT_FOUND
    close_response(response)

def apply_with_trailing(self, candidates, prefix, delimiter, match_glob):
    objs, prefixes = apply_delimiter(self, candidates, prefix, delimiter, match_glob)
    if trailing:
        n = len(prefix or "")
        objs += [o for name, o in candidates
                 if name[n:].endswith(delimiter) and name[n:].count(delimiter) == 1]
    return objs, prefixes

s.Response.close = deferred_close
s.Router.handle = locked_handle
s.Storage._apply_list_delimiter = apply_with_trailing
main(sys.argv[1:])
"""


def create_bucket(endpoint: str, name: str, project: str = GCS_PROJECT) -> None:
    """Create bucket ``name`` through the JSON API (``GcsFileSystem.create_dir`` also works)."""
    request = urllib.request.Request(
        f"{endpoint}/storage/v1/b?project={project}",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(request, timeout=10).close()


@contextmanager
def gcs_server(log: Path) -> Iterator[str]:
    """Start gcp-storage-emulator in memory on a free loopback port; yields its endpoint URL."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-c",
        _LAUNCHER,
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--in-memory",
    ]

    def is_up() -> bool:
        urllib.request.urlopen(f"{endpoint}/", timeout=1).close()  # its health check
        return True

    what = "gcp-storage-emulator (installed? `pip install gcp-storage-emulator`)"
    with server_process(cmd, log, is_up, what):
        yield endpoint
