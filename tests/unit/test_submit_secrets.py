"""What ``raytrain submit`` keeps off the wire and out of the cluster: secret-shaped files in
the working dir (checked in the package Ray itself builds from it), links out of it, a token
over plain http to another machine, credentials in ``--env``. None of it needs a cluster:
each is decided before anything is sent."""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

import pytest

from raytrain.cli import app as cli
from raytrain.submit import client as jobs_client
from raytrain.submit import connection, uploads
from raytrain.submit.client import JobsError
from tests.conftest import digits_spec, write_spec

CLOSED = "http://127.0.0.1:9"  # loopback, nothing listens: connecting fails at once
REMOTE = "http://head.invalid:8265"  # another machine (.invalid never resolves)

SECRET_FILES = [
    ".env",
    ".env.production",
    ".envrc",
    "id_rsa",
    "id_ed25519.pub",
    "hf_token",
    "secrets/auth.token",
    "secrets/token.json",
    "keys/server.pem",
    "tls.key",
    "credentials.json",
    "mlflow.db",
    "data/cache.db",
    ".aws/credentials",
    ".ssh/config",
    ".config/gcloud/application_default_credentials.json",
    "sub/.netrc",
]
KEPT_FILES = [
    "train.py",
    "tokenizer.json",
    "tokenizers/vocab.txt",
    "credentials.py",
    "token_utils.py",
    "id_to_label.json",
    "data/train.parquet",
    "README.md",
    ".config/app.yaml",
    "spec.yaml",
]
CONTENT = "CONTENT-THAT-MUST-NOT-PRINT"


@pytest.fixture
def no_ray_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in (
        "RAY_ADDRESS",
        "RAY_API_SERVER_ADDRESS",
        "RAY_AUTH_TOKEN",
        "RAY_AUTH_TOKEN_PATH",
        "RAY_RUNTIME_ENV_IGNORE_GITIGNORE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(connection, "DEFAULT_TOKEN_FILE", tmp_path / "no-such-token")
    return tmp_path


def _working_dir(tmp_path: Path, digits_dir: Path) -> Path:
    wd = tmp_path / "wd"
    for name in SECRET_FILES + KEPT_FILES:
        (wd / name).parent.mkdir(parents=True, exist_ok=True)
        (wd / name).write_text(CONTENT)
    write_spec(wd / "spec.yaml", digits_spec(digits_dir, tmp_path))
    (wd / ".gitignore").write_text("ignored/\n")
    (wd / "ignored").mkdir()
    (wd / "ignored" / "python").symlink_to("/usr/bin/env")  # ignored: never looked at
    (wd / "settings.ini").symlink_to(wd / ".env")  # a link inside, to a secret
    (wd / "data" / "train-link.parquet").symlink_to(wd / "data" / "train.parquet")
    return wd


def _package(wd: Path, excludes: list[str], out: Path) -> set[str]:
    """The names in the zip Ray builds of ``wd`` for a job: its own packaging code, with its
    own default excludes in front, as ``upload_working_dir_if_needed`` calls it."""
    from ray._private import ray_constants
    from ray._private.runtime_env.packaging import create_package

    every = ray_constants.get_runtime_env_default_excludes() + excludes
    create_package(str(wd), out, include_gitignore=True, excludes=every)
    with zipfile.ZipFile(out) as package:
        return {name.rstrip("/") for name in package.namelist()}


def test_secret_shaped_files_are_left_out_of_the_package(
    no_ray_env: Path, digits_dir: Path
) -> None:
    wd = _working_dir(no_ray_env, digits_dir)
    excludes, left_out = uploads.upload_excludes(wd)
    names = _package(wd, excludes, no_ray_env / "pkg.zip")
    sent = sorted(set(SECRET_FILES) & names)
    assert not sent, f"uploaded: {sent}"
    assert "settings.ini" not in names  # the link to .env: Ray would send .env's content
    for name in [*KEPT_FILES, "data/train-link.parquet"]:
        assert name in names, name
    assert not any(name.startswith("ignored") for name in names)
    assert ".aws/" in left_out and ".ssh/" in left_out
    assert "settings.ini (a link to .env)" in left_out
    for name in (".env", "id_rsa", "hf_token", "mlflow.db", "data/cache.db", "keys/server.pem"):
        assert name in left_out, name
    # --include sends one anyway
    excludes, left_out = uploads.upload_excludes(wd, include=["hf_token"])
    assert "hf_token" in _package(wd, excludes, no_ray_env / "pkg2.zip")
    assert "hf_token" not in left_out


def test_submit_names_what_it_left_out_never_the_content(
    no_ray_env: Path, digits_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wd = _working_dir(no_ray_env, digits_dir)
    spec = str(wd / "spec.yaml")
    code = cli.main(["submit", spec, "--address", CLOSED, "--working-dir", str(wd)])
    err = capsys.readouterr().err
    assert code == 2 and "no Ray job server answers" in err  # it got as far as connecting
    line = next(line for line in err.splitlines() if "left out of the upload" in line)
    assert ".env" in line and "id_rsa" in line and ".aws/" in line
    assert CONTENT not in err


def test_a_link_out_of_the_working_dir_is_refused_by_name(
    no_ray_env: Path, digits_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wd = _working_dir(no_ray_env, digits_dir)
    home_aws = no_ray_env / "home" / ".aws"
    home_aws.mkdir(parents=True)
    (home_aws / "credentials").write_text(CONTENT)
    (wd / "cloud.ini").symlink_to(home_aws / "credentials")  # Ray would follow it
    (wd / "data" / "shared").symlink_to(home_aws)
    with pytest.raises(JobsError) as excinfo:
        uploads.upload_excludes(wd)
    assert excinfo.value.exit_code == 2
    problems = excinfo.value.problems
    assert any(p.startswith(f"--working-dir {wd}: cloud.ini -> ") for p in problems), problems
    assert any("data/shared -> " in p for p in problems), problems
    spec = str(wd / "spec.yaml")
    code = cli.main(["submit", spec, "--address", CLOSED, "--working-dir", str(wd)])
    err = capsys.readouterr().err
    assert code == 2
    assert re.search(r"^error: .*cloud\.ini -> .*symbolic link out of the working dir", err, re.M)
    assert "no Ray job server" not in err  # refused before connecting
    assert CONTENT not in err


COMMANDS = [
    ["submit", "SPEC", "--working-dir", "WD"],
    ["status", "raysubmit_x"],
    ["logs", "raysubmit_x"],
    ["stop", "raysubmit_x"],
    ["list"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_token_over_plain_http_to_another_machine_is_refused(
    command: list[str],
    no_ray_env: Path,
    digits_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    wd = no_ray_env / "wd"
    wd.mkdir()
    spec = write_spec(wd / "spec.yaml", digits_spec(digits_dir, no_ray_env))
    argv = [str(spec) if a == "SPEC" else str(wd) if a == "WD" else a for a in command]
    monkeypatch.setenv("RAY_AUTH_TOKEN", "tok-0123456789")
    for address in (REMOTE, "10.0.0.5:8265"):  # a bare host:port is http too
        assert cli.main([*argv, "--address", address]) == 2
        err = capsys.readouterr().err
        assert "the cluster's token would travel in clear over http" in err, err
        assert "https://" in err and "ray dashboard" in err and "--insecure" in err
        assert "tok-0123456789" not in err
    # --insecure sends it (here: to a host that does not exist), with a warning
    assert cli.main([*argv, "--address", REMOTE, "--insecure"]) == 2
    err = capsys.readouterr().err
    assert "would travel in clear" not in err and "no Ray job server answers" in err
    assert "warning: --insecure" in err
    # loopback over http, or no token at all: nothing to refuse
    for address, token in ((CLOSED, "tok"), ("http://localhost:9", "tok"), (REMOTE, None)):
        if token is None:
            monkeypatch.delenv("RAY_AUTH_TOKEN")
        assert cli.main([*argv, "--address", address]) == 2
        assert "would travel in clear" not in capsys.readouterr().err


def test_the_python_api_refuses_it_too_unless_insecure(no_ray_env: Path) -> None:
    with pytest.raises(JobsError, match="would travel in clear"):
        jobs_client.list_jobs(address=REMOTE, token="t")
    with pytest.raises(JobsError, match="would travel in clear"):
        jobs_client.attach("raysubmit_x", address="http://192.0.2.1:8265", token="t")
    with pytest.raises(JobsError, match="no Ray job server answers"):
        jobs_client.list_jobs(address=REMOTE, token="t", insecure=True)
    connection.check_transport("https://head.example.com:8443", "t")  # TLS: fine
    connection.check_transport("http://[::1]:8265", "t")  # loopback: fine


def test_a_link_into_an_ignored_folder_is_walked_as_ray_uploads_it(tmp_path: Path) -> None:
    """Ray uploads a linked folder's files under the link's path: what the folder's own
    (ignored) place hides is uploaded through the link, links out of the working dir too."""
    from ray._private.runtime_env.packaging import _zip_files

    outside = tmp_path / "home" / ".aws"
    outside.mkdir(parents=True)
    (outside / "config").write_text(CONTENT)
    wd = tmp_path / "wd"
    (wd / "cache").mkdir(parents=True)
    (wd / ".gitignore").write_text("cache/\n")
    (wd / "cache" / "shared").symlink_to(outside)  # ignored where it is...
    (wd / "c").symlink_to("cache")  # ...uploaded as c/shared/config
    (wd / "loop").symlink_to(".")  # a loop is not walked forever
    (wd / "train.py").write_text("x")
    # what Ray would upload without the check: the file outside
    _zip_files(str(wd), ["loop"], str(tmp_path / "ray.zip"), True)
    assert "c/shared/config" in zipfile.ZipFile(tmp_path / "ray.zip").namelist()
    with pytest.raises(JobsError) as excinfo:
        uploads.upload_excludes(wd)
    assert any("c/shared -> " in p for p in excinfo.value.problems), excinfo.value.problems


@pytest.mark.parametrize(
    "address",
    [
        "http://127.0.0.1.evil.example:8265",
        "http://localhost@evil.example:8265",
        "http://localhost:8265@evil.example",
        "http://localhost\\@evil.example",
        "http://evil.example#@localhost",
        "http://evil.example:8265?x=@localhost",
        "HTTP://evil.example:8265",
        "Http://evil.example",
        "evil.example:8265",
        " evil.example:8265 ",
        "0.0.0.0:8265",
        "http://127.0.0.1:8265\t@evil.example",
    ],
)
def test_a_token_is_refused_to_every_spelling_of_a_remote_http_host(address: str) -> None:
    """The scheme is case-insensitive (HTTP:// was refused as not an http URL at all), and
    user info, fragments and look-alike names never make a remote host loopback."""
    with pytest.raises(JobsError, match="would travel in clear"):
        connection.check_transport(connection.resolve_address(address), "t")


def test_an_upper_case_scheme_is_http() -> None:
    assert connection.resolve_address("HTTP://LocalHost:8265") == "http://LocalHost:8265"
    assert connection.resolve_address("HTTPS://head:443/") == "https://head:443"
    connection.check_transport(connection.resolve_address("HTTP://localhost:8265"), "t")


def test_a_401_after_sending_a_token_says_the_token_was_refused() -> None:
    from ray._private.authentication.http_token_authentication import (
        format_authentication_http_error,
    )
    from ray.exceptions import AuthenticationError

    # the job server's own 401 and 403 texts, as its client raises them
    missing = AuthenticationError(
        format_authentication_http_error(401, "Unauthorized: Missing authentication token")
    )
    invalid = AuthenticationError(
        format_authentication_http_error(403, "Forbidden: Invalid authentication token")
    )
    sent = connection._refused(missing, CLOSED, "$RAY_AUTH_TOKEN")
    assert sent is not None and "the token was refused" in str(sent)
    assert "none was found" not in str(sent) and "$RAY_AUTH_TOKEN" in str(sent)
    unsent = connection._refused(missing, CLOSED, None)
    assert unsent is not None and "requires a token; none was found" in str(unsent)
    wrong = connection._refused(invalid, CLOSED, "$RAY_AUTH_TOKEN")
    assert wrong is not None and "refused the token from $RAY_AUTH_TOKEN" in str(wrong)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("AZURE_STORAGE_ACCOUNT_KEY", "k"),
        ("AZURE_STORAGE_KEY", "k"),
        ("AZURE_STORAGE_CONNECTION_STRING", "DefaultEndpointsProtocol=https;AccountKey=k"),
        ("DATABASE_URL", "postgresql://db/x"),
        ("GCP_PRIVATE_KEY", "k"),
        ("MY_SERVICE_ACCOUNT_JSON", "{}"),
        ("GOOGLE_SERVICE_ACCOUNT", "x"),
        ("MLFLOW_TRACKING_URI", "https://alice:pw@mlflow.example.com"),
        ("MLFLOW_TRACKING_PASSWORD", "x"),
        ("HF_TOKEN", "x"),
        ("DBPASSWORD", "x"),
        ("AWS_SECRET_ACCESS_KEY", "x"),
        ("DATA_URL", "https://a.blob.core.windows.net/c?sig=x"),
        ("DB_PASS", "x"),
        ("SMTP_PASS", "x"),
        ("KAGGLE_KEY", "x"),
        ("ACCESSTOKEN", "x"),
        ("REDIS_URL", "redis://:pw@cache:6379"),
        ("API_HEADERS", "Authorization: Basic dTpw"),
    ],
)
def test_credentials_in_env_are_warned_about(name: str, value: str) -> None:
    from raytrain.spec import load_spec

    job = load_spec(
        {"name": "w", "model": {"class_path": "m:M"}, "data": {"train": {"uri": "s3://b/train"}}}
    )
    notes = jobs_client._warnings(job, {name: value, "LOG_LEVEL": "info"})
    assert any(n.startswith(f"--env {name}:") for n in notes), notes
    assert not any("LOG_LEVEL" in n for n in notes)
    assert value not in "".join(notes) or len(value) < 3


def test_credentials_in_overrides_and_the_spec_are_warned_about() -> None:
    from raytrain.spec import load_spec

    overrides = [
        "model.init_args.hf_token=abc",
        "model.init_args.lr=0.1",
        "model.init_args.mirror=https://u:pw@hub.example.com",
    ]
    job = load_spec(
        {"name": "w", "model": {"class_path": "m:M"}, "data": {"train": {"uri": "s3://b/train"}}},
        overrides,
    )
    notes = jobs_client._warnings(job, {}, overrides)
    assert any(n.startswith("override model.init_args.hf_token:") for n in notes), notes
    assert any(n.startswith("override model.init_args.mirror:") for n in notes), notes
    assert not any("init_args.lr" in n for n in notes)
    assert any(
        n.startswith("model.init_args.hf_token, model.init_args.mirror: credential-like")
        for n in notes
    ), notes
    assert not any("abc" in n or "pw@" in n for n in notes)


def test_plain_env_is_not_warned_about() -> None:
    from raytrain.spec import load_spec

    job = load_spec(
        {"name": "w", "model": {"class_path": "m:M"}, "data": {"train": {"uri": "s3://b/train"}}}
    )
    env = {
        "MLFLOW_TRACKING_URI": "https://mlflow.example.com",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "4",
    }
    assert not any(n.startswith("--env") for n in jobs_client._warnings(job, env))


def test_an_env_flag_without_equals_is_not_echoed(
    no_ray_env: Path, digits_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wd = no_ray_env / "wd"
    wd.mkdir()
    spec = write_spec(wd / "spec.yaml", digits_spec(digits_dir, no_ray_env))
    argv = ["submit", str(spec), "--address", CLOSED, "--working-dir", str(wd)]
    assert cli.main([*argv, "--env", "A=1", "--env", "hunter2-secret-value"]) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err
    assert re.search(r"^error: --env #2: expected KEY=VALUE", err, re.M), err
    assert os.environ.get("A") is None
