"""What a storage error means (``storage.cause``/``describe``), on the exceptions pyarrow
really raises, without a cloud or a Ray cluster.

The S3 errors come from pyarrow's S3 client (the AWS SDK) talking to a stand-in endpoint: a
stdlib HTTP server on loopback that answers every request with the status and S3 error code
a test sets. The SDK parses them into the texts a real store's refusals give.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raytrain import storage
from raytrain.spec import StorageSpec
from tests.conftest import serving

CREDENTIALS = "the credentials were rejected"
DENIED = "access denied (no permission)"
UNREACHABLE = "the endpoint cannot be reached"
NO_BUCKET = "the bucket does not exist"


class _Refusing(BaseHTTPRequestHandler):
    """Answers every request with the server's ``status`` and S3 error ``code``."""

    server: S3Refusals

    def _reply(self) -> None:
        code = self.server.code
        body = f"<Error><Code>{code}</Code><Message>refused by the test</Message></Error>".encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _reply

    def log_message(self, *args: object) -> None:
        return None


class S3Refusals(ThreadingHTTPServer):
    status = 403
    code = "AccessDenied"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


@pytest.fixture(scope="module")
def server() -> Iterator[S3Refusals]:
    with serving(S3Refusals(("127.0.0.1", 0), _Refusing)) as srv:
        yield srv


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials from the standard chain (any: the stand-in checks none), no profiles."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIATESTTESTTESTTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-for-the-test")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def _s3(endpoint: str) -> pafs.S3FileSystem:
    return pafs.S3FileSystem(
        endpoint_override=endpoint,
        scheme="http",
        region="us-east-1",
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
        connect_timeout=2,
    )


def _head(fs: pafs.FileSystem) -> None:
    fs.get_file_info("bucket/key")


def _list(fs: pafs.FileSystem) -> None:
    fs.get_file_info(pafs.FileSelector("bucket/runs"))


def _put(fs: pafs.FileSystem) -> None:
    with fs.open_output_stream("bucket/key") as stream:
        stream.write(b"x")


def _raised(call: Callable[[pafs.FileSystem], None], fs: pafs.FileSystem) -> OSError:
    with pytest.raises(OSError) as caught:
        call(fs)
    return caught.value


@pytest.mark.parametrize(
    ("status", "code", "call", "meaning"),
    [
        (403, "AccessDenied", _head, DENIED),
        (403, "AccessDenied", _list, DENIED),
        (403, "AccessDenied", _put, DENIED),
        (403, "InvalidAccessKeyId", _list, CREDENTIALS),
        (403, "InvalidAccessKeyId", _put, CREDENTIALS),
        (403, "SignatureDoesNotMatch", _list, CREDENTIALS),
        (400, "ExpiredToken", _list, CREDENTIALS),
        (404, "NoSuchBucket", _list, NO_BUCKET),
        (404, "NoSuchBucket", _put, NO_BUCKET),
        (500, "InternalError", _list, None),  # a fault that means nothing in particular
    ],
)
def test_the_stores_refusals_are_named(
    server: S3Refusals,
    status: int,
    code: str,
    call: Callable[[pafs.FileSystem], None],
    meaning: str | None,
) -> None:
    server.status, server.code = status, code
    error = _raised(call, _s3(server.endpoint))
    assert storage.cause(error) == meaning
    line = storage.describe(error)
    assert "\n" not in line
    if meaning:
        assert line.startswith(f"{meaning} (") and line.endswith(")")
    else:
        assert line == " ".join(str(error).split())


def test_rejected_credentials_look_like_a_denial_on_a_head(server: S3Refusals) -> None:
    # a HEAD has no body to name the cause: why check_writable lists before anything else
    server.status, server.code = 403, "InvalidAccessKeyId"
    fs = _s3(server.endpoint)
    assert storage.cause(_raised(_head, fs)) == DENIED
    assert storage.cause(_raised(_list, fs)) == CREDENTIALS


def test_an_endpoint_nobody_listens_on_cannot_be_reached() -> None:
    with socket.socket() as probe:  # a port free now, with nothing listening on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    error = _raised(_head, _s3(f"127.0.0.1:{port}"))
    assert storage.cause(error) == UNREACHABLE


def test_a_status_code_is_not_read_out_of_a_port_number() -> None:
    """The port a test's server had (40111) once made an unreachable endpoint read as
    rejected credentials ("401" inside it); a status is a number of its own."""
    for port in (40111, 40312, 14010):
        error = OSError(
            f"When listing objects under key 'runs' in bucket 'b': AWS Error "
            f"NETWORK_CONNECTION during ListObjectsV2 operation: curlCode: 7, "
            f"Could not connect to server; Details: Failed to connect to "
            f"127.0.0.1 port {port} after 0 ms"
        )
        assert storage.cause(error) == UNREACHABLE
    assert storage.cause(OSError("HTTP status 401 returned")) == storage.cause(
        OSError("Unauthorized")
    )
    assert storage.cause(OSError("status code: 403")) == DENIED


def test_local_errors_keep_their_own_words(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as caught:
        pafs.LocalFileSystem().open_input_stream(str(tmp_path / "missing"))
    assert storage.cause(caught.value) is None
    assert storage.describe(caught.value) == " ".join(str(caught.value).split())
    assert str(tmp_path / "missing") in storage.describe(caught.value)


def test_a_long_error_is_cut_to_one_short_line() -> None:
    error = OSError("AWS Error ACCESS_DENIED during PutObject operation:\n" + "x " * 400)
    line = storage.describe(error)
    assert line.startswith(f"{DENIED} (AWS Error ACCESS_DENIED during PutObject operation: x")
    assert line.endswith("...)") and "\n" not in line
    assert len(line) < 360


def _spec(server: S3Refusals) -> StorageSpec:
    return StorageSpec.model_validate(
        {
            "s3": {"endpoint_url": f"http://{server.endpoint}", "region": "us-east-1"},
            "max_attempts": 1,
        }
    )


@pytest.mark.parametrize(
    ("status", "code", "why"),
    [
        (403, "InvalidAccessKeyId", f"cannot list it: {CREDENTIALS} ("),
        (403, "AccessDenied", f"cannot list it: {DENIED} ("),
        (500, "InternalError", "cannot list it: "),
    ],
)
def test_check_writable_says_why_a_store_cannot_hold_a_run(
    server: S3Refusals, status: int, code: str, why: str
) -> None:
    server.status, server.code = status, code
    reason = storage.check_writable("s3://bucket/runs", _spec(server))
    assert reason is not None and reason.startswith(why)


def test_a_bucket_that_refuses_its_head_is_taken_to_exist(server: S3Refusals) -> None:
    # a user may be let into a bucket's keys without the right to HeadBucket
    server.status, server.code = 403, "AccessDenied"
    assert storage.missing_bucket("s3://bucket/runs", _spec(server)) is None
    server.status, server.code = 403, "InvalidAccessKeyId"
    assert storage.missing_bucket("s3://bucket/runs", _spec(server)) is None


def test_a_record_in_a_store_that_cannot_be_reached_or_refuses_is_one_line(
    server: S3Refusals, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``raytrain status NAME --storage s3://...``: a store that is not there, or that
    refuses, is one ``error:`` line naming the record, exit 2, never an OSError traceback."""
    from raytrain.cli import app as cli

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    for endpoint, cause in ((closed, UNREACHABLE), (f"http://{server.endpoint}", DENIED)):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        assert cli.main(["status", "r", "--storage", "s3://bucket/runs"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith(
            f"error: s3://bucket/runs/r/raytrain-status.json: cannot read it: {cause}"
        )
