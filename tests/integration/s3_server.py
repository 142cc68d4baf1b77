"""A real S3 API server on loopback (moto_server), started and stopped by the tests."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.integration.servers import free_port, server_process

# Test credentials for the local server; real runs take theirs from the provider's chain.
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _answers(url: str) -> bool:
    urllib.request.urlopen(url, timeout=1).close()
    return True


@contextmanager
def moto_server(log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start ``moto_server`` on a free loopback port; yields its endpoint URL."""
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    endpoint = f"http://127.0.0.1:{port}"
    cmd = [str(exe), "-H", "127.0.0.1", "-p", str(port)]
    with server_process(
        cmd,
        log,
        lambda: _answers(f"{endpoint}/moto-api/"),
        "moto_server",
        env={**os.environ, **(env or {})},
    ):
        yield endpoint


def s3_client(endpoint: str, access_key: str = "testing", secret_key: str = "testing") -> Any:
    """A boto3 S3 client for the test server (to set it up and inspect it)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
    )


@dataclass(frozen=True)
class AuthServer:
    """An S3 server that checks credentials: an admin and a read-only user's keys."""

    endpoint: str
    admin: dict[str, str]  # AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
    reader: dict[str, str]


# moto checks credentials against its IAM users once this many requests have been served;
# the first ones create the admin user (create_user, create_access_key, put_user_policy)
# and the reader user.
_UNAUTHENTICATED_SETUP_REQUESTS = 4


@contextmanager
def moto_auth_server(log: Path) -> Iterator[AuthServer]:
    """``moto_server`` enforcing IAM auth, with an all-powerful and a read-only user."""
    import boto3

    env = {"INITIAL_NO_AUTH_ACTION_COUNT": str(_UNAUTHENTICATED_SETUP_REQUESTS)}
    with moto_server(log, env) as endpoint:

        def iam(key: str, secret: str) -> Any:
            return boto3.client(
                "iam",
                endpoint_url=endpoint,
                region_name="us-east-1",
                aws_access_key_id=key,
                aws_secret_access_key=secret,
            )

        def policy(actions: list[str]) -> str:
            statement = {"Effect": "Allow", "Action": actions, "Resource": "*"}
            return json.dumps({"Version": "2012-10-17", "Statement": [statement]})

        setup = iam("setup", "setup")
        setup.create_user(UserName="admin")
        key = setup.create_access_key(UserName="admin")["AccessKey"]
        setup.put_user_policy(UserName="admin", PolicyName="all", PolicyDocument=policy(["*"]))
        setup.create_user(UserName="reader")  # the last unauthenticated request
        admin = iam(key["AccessKeyId"], key["SecretAccessKey"])
        rkey = admin.create_access_key(UserName="reader")["AccessKey"]
        # Read-only as AWS's managed AmazonS3ReadOnlyAccess grants it (Get*, List*). moto 5.2.6
        # checks each request against its API operation's own name (ListObjectsV2, HeadObject,
        # HeadBucket) where AWS and moto 5.2.5 check s3:ListBucket and s3:GetObject, so the
        # two HEADs are named too: without them CI's fresh install (5.2.6) denied the reader's
        # reads and failed test_no_write_permission.
        read_only = policy(["s3:Get*", "s3:List*", "s3:HeadObject", "s3:HeadBucket"])
        admin.put_user_policy(UserName="reader", PolicyName="ro", PolicyDocument=read_only)
        yield AuthServer(endpoint, _env_keys(key), _env_keys(rkey))


def _env_keys(key: dict[str, str]) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
    }


def s3_filesystem(endpoint: str, keys: dict[str, str] | None = None) -> Any:
    """A pyarrow S3 filesystem on the test server, with the test (or given) credentials."""
    import pyarrow.fs as pafs

    keys = keys or S3_ENV
    return pafs.S3FileSystem(
        endpoint_override=endpoint,
        region="us-east-1",
        access_key=keys["AWS_ACCESS_KEY_ID"],
        secret_key=keys["AWS_SECRET_ACCESS_KEY"],
    )
