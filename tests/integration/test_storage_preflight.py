"""Storage problems stop a run before any worker is reserved: exit 2, a message naming the
URI and the cause, well within 30 s, against real S3 API servers (one of them checking
credentials). Transient faults are retried; permanent ones are not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from raytrain import storage
from raytrain.spec import StorageSpec
from tests.integration.cli_runs import cli_env, digits_on_s3, run_cli
from tests.integration.s3_server import AuthServer, moto_auth_server, s3_client
from tests.integration.servers import free_port

pytestmark = pytest.mark.integration

# A preflight failure must come within this; the subprocess is killed (a failure) after it.
PREFLIGHT_LIMIT_S = 30


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory, digits_dir: Path) -> Iterator[AuthServer]:
    """An S3 server checking credentials, holding the digits in ``s3://guarded``."""
    import pyarrow.fs as pafs

    from tests.integration.s3_server import s3_filesystem

    with moto_auth_server(tmp_path_factory.mktemp("moto-auth") / "moto.log") as server:
        admin = server.admin
        s3_client(
            server.endpoint, admin["AWS_ACCESS_KEY_ID"], admin["AWS_SECRET_ACCESS_KEY"]
        ).create_bucket(Bucket="guarded")
        fs = s3_filesystem(server.endpoint, admin)
        pafs.copy_files(str(digits_dir), "guarded/digits", pafs.LocalFileSystem(), fs)
        yield server


def refused(env: dict[str, str], cwd: Path, *args: str) -> str:
    """Run the job; assert it exits 2 before training, and return its output."""
    code, _, out = run_cli(env, cwd, *args, timeout=PREFLIGHT_LIMIT_S)
    assert code == 2, out[-3000:]
    assert "Traceback" not in out
    assert "epoch 1" not in out  # no worker started
    return out


def test_missing_bucket(s3_endpoint: str, s3_digits: str, tmp_path: Path) -> None:
    out = refused(
        cli_env(AWS_ENDPOINT_URL=s3_endpoint),
        tmp_path,
        *digits_on_s3(s3_digits, "runs"),
        "checkpoint.storage=s3://no-such-bucket/runs",
    )
    assert (
        "checkpoint.storage: s3://no-such-bucket/runs: the bucket 'no-such-bucket' does not exist"
        in out
    )


def test_empty_prefix_and_missing_column(s3_endpoint: str, s3_digits: str, tmp_path: Path) -> None:
    out = refused(
        cli_env(AWS_ENDPOINT_URL=s3_endpoint),
        tmp_path,
        *digits_on_s3(s3_digits, "runs"),
        f"data.train.uri={s3_digits}/nothing-here",
        "data.columns=[pixels,label,colour]",
    )
    empty = f"data.train.uri: {s3_digits}/nothing-here: nothing there (an empty or missing prefix)"
    assert empty in out
    val = f"{s3_digits}/digits/val"
    assert f"data.columns: 'colour' not in data.val ({val} has: id, pixels, label)" in out


def test_unreachable_endpoint(s3_digits: str, tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = refused(
        cli_env(), tmp_path, *digits_on_s3(s3_digits, "runs"), f"storage.s3.endpoint_url={closed}"
    )
    unreachable = "the endpoint cannot be reached"
    assert f"checkpoint.storage: {s3_digits}/runs: cannot list it: {unreachable}" in out
    train = f"{s3_digits}/digits/train"
    assert f"data.train.uri: cannot read parquet data at {train}: {unreachable}" in out


def test_wrong_credentials(auth_server: AuthServer, tmp_path: Path) -> None:
    env = cli_env(
        AWS_ENDPOINT_URL=auth_server.endpoint,
        AWS_ACCESS_KEY_ID="AKIANOSUCHKEY000000",
        AWS_SECRET_ACCESS_KEY="wrong",
    )
    out = refused(env, tmp_path, *digits_on_s3("s3://guarded", "runs"))
    rejected = "the credentials were rejected"
    assert f"checkpoint.storage: s3://guarded/runs: cannot list it: {rejected}" in out
    train = "s3://guarded/digits/train"
    assert f"data.train.uri: cannot read parquet data at {train}: {rejected}" in out


def test_no_write_permission(auth_server: AuthServer, tmp_path: Path) -> None:
    """A read-only user may read the data but not hold the run's checkpoints there."""
    env = cli_env(AWS_ENDPOINT_URL=auth_server.endpoint, **auth_server.reader)
    out = refused(env, tmp_path, *digits_on_s3("s3://guarded", "runs"))
    denied = "cannot write: access denied (no permission)"
    assert f"checkpoint.storage: s3://guarded/runs: {denied}" in out
    assert "data.train.uri" not in out  # the data is readable


def test_transient_faults_are_retried_and_permanent_ones_not(
    s3_endpoint: str, s3_digits: str
) -> None:
    from tests.integration.s3_proxy import s3_proxy

    with s3_proxy(s3_endpoint) as proxy:
        options = StorageSpec(s3={"endpoint_url": proxy.endpoint, "region": "us-east-1"})
        where = f"{s3_digits}/probe"
        proxy.fail_next(2, status=503, code="SlowDown")
        assert storage.check_writable(where, options) is None  # retried with backoff
        assert proxy.failed == 2
        proxy.fail_next(1, status=403, code="AccessDenied")
        before = len(proxy.requests)
        why = storage.check_writable(where, options)
        assert why is not None and "access denied" in why
        assert proxy.failed == 3
        assert len(proxy.requests) == before + 1  # answered at once, not retried
