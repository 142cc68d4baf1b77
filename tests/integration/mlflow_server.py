"""A real MLflow tracking server on loopback, as a team runs one: ``mlflow server`` with a
SQLite backend store and its artifacts proxied to an S3 bucket (the test S3 server), with
or without MLflow's basic-auth app."""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.integration.s3_server import S3_ENV
from tests.integration.servers import free_port, http_answers, server_process

MLFLOW_CLI = str(Path(sys.executable).parent / "mlflow")


@dataclass
class MlflowServer:
    uri: str
    artifacts: str  # s3://bucket/prefix the server writes artifacts to
    # the admin's credentials when the server runs the basic-auth app
    username: str | None = None
    password: str | None = None


@contextmanager
def mlflow_server(
    work: Path, s3_endpoint: str, bucket: str, *, auth: bool = False
) -> Iterator[MlflowServer]:
    """Run ``mlflow server`` until the block ends; the bucket must exist."""
    port = free_port()
    artifacts = f"s3://{bucket}/mlartifacts"
    cmd = [
        MLFLOW_CLI,
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{work / 'mlflow.db'}",
        "--artifacts-destination",
        artifacts,
    ]
    env = {**S3_ENV, "MLFLOW_S3_ENDPOINT_URL": s3_endpoint}
    username = password = None
    if auth:
        username, password = "admin", secrets.token_urlsafe(16)
        config = work / "basic_auth.ini"
        config.write_text(
            "[mlflow]\ndefault_permission = READ\n"
            f"database_uri = sqlite:///{work / 'auth.db'}\n"
            f"admin_username = {username}\nadmin_password = {password}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        )
        cmd += ["--app-name", "basic-auth"]
        env["MLFLOW_AUTH_CONFIG_PATH"] = str(config)
        env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = secrets.token_hex(16)  # its CSRF protection
    uri = f"http://127.0.0.1:{port}"
    with server_process(
        cmd,
        work / "mlflow-server.log",
        lambda: http_answers(f"{uri}/health"),
        "mlflow server",
        env={**os.environ, **env},
    ):
        yield MlflowServer(uri, artifacts, username, password)
