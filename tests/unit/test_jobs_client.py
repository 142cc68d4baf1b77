"""What ``raytrain submit`` decides before it talks to a cluster: the address, the token,
the job's command, and the input it refuses (each with exit code 2 and nothing sent)."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from raytrain.cli import app as cli
from raytrain.submit import client as jobs_client
from raytrain.submit import connection
from raytrain.submit.connection import JobsError, resolve_address, resolve_token
from tests.conftest import digits_spec, serving, write_spec

# A loopback port nothing listens on: connecting there fails at once.
CLOSED = "http://127.0.0.1:9"


@pytest.fixture
def no_ray_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(connection, "DEFAULT_TOKEN_FILE", tmp_path / "no-such-token")
    return tmp_path


def test_the_address_comes_from_the_flag_then_rays_variables(
    no_ray_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(JobsError, match="no cluster address"):
        resolve_address(None)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a GCS address is not a job server
    with pytest.raises(JobsError, match="no cluster address"):
        resolve_address(None)
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://head:8265/")
    assert resolve_address(None) == "http://head:8265"
    assert resolve_address("head:8265") == "http://head:8265"
    with pytest.raises(JobsError, match="ray://head:10001"):
        resolve_address("ray://head:10001")


@pytest.mark.parametrize(
    "address, why",
    [
        ("http://[::1", "not a URL (Invalid IPv6 URL)"),  # was urllib's traceback, exit 1
        ("http://127.0.0.1:99999", "not a URL (Port out of range"),
        ("http://:8265", "names no host"),
    ],
)
def test_an_address_that_is_no_url_is_one_line_exit_2(
    no_ray_env: Path, capsys: pytest.CaptureFixture[str], address: str, why: str
) -> None:
    for argv in (["list", "--address", address], ["stop", "j", "--address", address]):
        assert cli.main([*argv, "--insecure"]) == 2, argv
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert "Traceback" not in captured.err and len(lines) == 1, argv
        assert lines[0].startswith(f"error: --address {address}: {why}"), argv


def test_the_token_comes_from_the_argument_the_variable_then_the_files(
    no_ray_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_token() is None
    home_file = no_ray_env / "home-token"
    home_file.write_text("from-home\n")
    monkeypatch.setattr(connection, "DEFAULT_TOKEN_FILE", home_file)
    assert resolve_token() == "from-home"
    path_file = no_ray_env / "path-token"
    path_file.write_text("from-path\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path_file))
    assert resolve_token() == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert resolve_token() == "from-env"
    assert resolve_token("given") == "given"
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(no_ray_env / "missing"))
    with pytest.raises(JobsError, match=r"RAY_AUTH_TOKEN_PATH=.*missing"):
        resolve_token()


def test_the_entrypoint_is_raytrains_cli_with_quoted_overrides() -> None:
    command = jobs_client.entrypoint(
        "jobs/a b.yaml", ["tracking.mlflow.tags={k: 'v w'}"], ["--fresh"]
    )
    assert shlex.split(command) == [
        "python",
        "-m",
        "raytrain",
        "run",
        "jobs/a b.yaml",
        "tracking.mlflow.tags={k: 'v w'}",
        "--fresh",
    ]


def test_a_sweep_is_submitted_as_raytrain_tune() -> None:
    command = jobs_client.entrypoint("sweep.yaml", [], ["--fresh"], "tune")
    assert shlex.split(command) == ["python", "-m", "raytrain", "tune", "sweep.yaml", "--fresh"]


def test_status_lines_of_a_sweep_are_its_trials() -> None:
    from raytrain.cli.jobs import sweep_lines

    logs = (
        "raytrain: sweep s: 2 sample(s)\nraytrain: trial s-000 finished after 1 epoch(s): "
        "val_acc 0.9 (lr=0.01)\nother\nraytrain: trial s-001 stopped after 1 epoch(s)\n"
    )
    assert sweep_lines(logs) == [
        "s-000 finished after 1 epoch(s): val_acc 0.9 (lr=0.01)",
        "s-001 stopped after 1 epoch(s)",
    ]


def _spec(tmp_path: Path, digits_dir: Path) -> Path:
    wd = tmp_path / "wd"
    wd.mkdir()
    return write_spec(wd / "spec.yaml", digits_spec(digits_dir, tmp_path))


def test_bad_input_is_refused_before_anything_is_sent(
    no_ray_env: Path, digits_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(no_ray_env, digits_dir)
    cases = [
        (
            ["submit", str(spec), "--address", CLOSED, "--working-dir", str(no_ray_env / "x")],
            "--working-dir .*: not a directory",
        ),
        (
            ["submit", str(spec), "--address", CLOSED, "--working-dir", str(digits_dir)],
            "the spec is outside the working directory",
        ),
        (
            [
                "submit",
                str(spec),
                "trainer.max_epochs=0",
                "--address",
                CLOSED,
                "--working-dir",
                str(spec.parent),
            ],
            "trainer.max_epochs",
        ),
        (
            [
                "submit",
                str(spec),
                "--address",
                CLOSED,
                "--working-dir",
                str(spec.parent),
                "--env",
                "RAY_AUTH_TOKEN=abc",
            ],
            "--env RAY_AUTH_TOKEN",
        ),
        (
            [
                "submit",
                str(spec),
                "--address",
                CLOSED,
                "--working-dir",
                str(spec.parent),
                "--env",
                "A=1",
                "--env",
                "NOEQUALS",
            ],
            "--env #2: expected KEY=VALUE",
        ),
        (["status", "raysubmit_x"], "no cluster address"),
        (
            [
                "submit",
                str(spec),
                "--address",
                CLOSED,
                "--working-dir",
                str(spec.parent),
                "--max-resubmits",
                "2",
            ],
            "--max-resubmits: only with --supervise",
        ),
        (
            [
                "submit",
                str(spec),
                "--address",
                CLOSED,
                "--working-dir",
                str(spec.parent),
                "--head-wait",
                "5",
                "--max-resubmits",
                "0",
            ],
            "--max-resubmits and --head-wait: only with --supervise",
        ),
        (
            [
                "submit",
                str(spec),
                "--address",
                CLOSED,
                "--working-dir",
                str(spec.parent),
                "--supervise",
                "--head-wait",
                "inf",
            ],
            "--head-wait inf: must be more than 0",
        ),
    ]
    for argv, message in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert re.search(f"^error: .*{message}", err, re.MULTILINE), (argv, err)


def test_an_address_where_no_job_server_answers_is_named(
    no_ray_env: Path, digits_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(no_ray_env, digits_dir)
    code = cli.main(["submit", str(spec), "--address", CLOSED, "--working-dir", str(spec.parent)])
    assert code == 2
    assert f"{CLOSED}: no Ray job server answers there" in capsys.readouterr().err
    with pytest.raises(JobsError, match="no Ray job server"):
        jobs_client.list_jobs(address=CLOSED)


def test_credentials_in_env_and_paths_lost_with_the_job_are_warned_about() -> None:
    from raytrain.spec import load_spec

    job = load_spec(
        {"name": "w", "model": {"class_path": "m:M"}, "data": {"train": {"uri": "s3://b/train"}}}
    )
    notes = jobs_client._warnings(job, {"MLFLOW_TRACKING_PASSWORD": "x", "LOG_LEVEL": "info"})
    assert any(n.startswith("--env MLFLOW_TRACKING_PASSWORD:") for n in notes)
    assert not any("LOG_LEVEL" in n for n in notes)
    assert any(n.startswith("checkpoint.storage 'runs' is a relative path") for n in notes)
    assert any("MLflow record lands in the job's working dir" in n for n in notes)


# --- a stand-in Ray job server: what raytrain sends, and what a hostile one answers ---

HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x1b[1A\rfaked\x9b31m"


class _JobServerHandler(BaseHTTPRequestHandler):
    """Answers the job API's GETs (version, list, a job, its logs) from ``server.jobs``,
    recording every path asked for."""

    server: FakeJobServer

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        path = self.path.split("?", 1)[0]
        if path == "/api/version":
            body: Any = {"version": "4", "ray_version": "2.60.0", "ray_commit": "x"}
        elif path == "/api/jobs/":
            body = list(self.server.jobs.values())
        elif path.startswith("/api/jobs/") and path.endswith("/logs"):
            body = {"logs": self.server.logs}
        elif path.removeprefix("/api/jobs/") in self.server.jobs:
            body = self.server.jobs[path.removeprefix("/api/jobs/")]
        else:
            self.send_error(404, "Job does not exist")
            return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return None


class FakeJobServer(ThreadingHTTPServer):
    jobs: dict[str, dict[str, Any]]
    paths: list[str]
    logs = ""

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _job(submission_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "type": "SUBMISSION",
        "job_id": None,
        "submission_id": submission_id,
        "status": "RUNNING",
        "entrypoint": "python -m raytrain run spec.yaml",
        "message": None,
        "metadata": {},
        **fields,
    }


@pytest.fixture
def job_server(no_ray_env: Path) -> Iterator[FakeJobServer]:
    with serving(FakeJobServer(("127.0.0.1", 0), _JobServerHandler)) as server:
        server.jobs, server.paths = {}, []
        yield server


def test_a_job_id_that_is_not_one_is_refused_before_any_request(
    job_server: FakeJobServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """``logs ../../api/version`` once sent the token to GET /api/version; ``?``/``#``
    injected a query; an empty id hit the list; a 100k-character id pasted a 414 page."""
    address = ["--address", job_server.address]
    for bad in (
        "../../api/version",
        "../../../api/x",
        "a?b=1",
        "a#b",
        "",
        ".",
        "..",
        "x" * 100_000,
        "a/b",
        "a b",
        "-x",
        "é",
    ):
        for command in ("logs", "stop", "status"):
            assert (
                cli.main(
                    [command, bad, *address] if bad != "-x" else [command, *address, "--", bad]
                )
                == 2
            ), (command, bad)
            err = capsys.readouterr().err
            assert err.startswith("error: JOB_ID ") and err.count("\n") == 1, err
            assert len(err) < 400
        with pytest.raises(JobsError, match="not a job id"):
            jobs_client.attach(bad, address=job_server.address)
    assert job_server.paths == []
    server = jobs_client.JobServer(job_server.address)
    with pytest.raises(JobsError, match=re.escape("job id '../x'")):
        jobs_client.JobHandle("../x", server)  # e.g. a hostile server's submission answer
    for good in (
        "raysubmit_4LamXRuQpYdSMg7J",
        "02000000",
        "my-run.2024_01",
        jobs_client.again_id("x" * connection.JOB_ID_MAX_CHARS),
    ):
        connection.check_job_id(good)


def test_ids_reach_the_server_as_one_encoded_path_segment(
    job_server: FakeJobServer, capsys: pytest.CaptureFixture[str]
) -> None:
    job_server.jobs["raysubmit_abc"] = _job("raysubmit_abc")
    job_server.logs = "line 1\n"
    assert cli.main(["logs", "raysubmit_abc", "--address", job_server.address]) == 0
    assert capsys.readouterr().out == "line 1\n"
    assert job_server.paths[-2:] == ["/api/jobs/raysubmit_abc", "/api/jobs/raysubmit_abc/logs"]
    assert connection.job_segment("a.b-c_d") == "a.b-c_d"


def test_what_a_job_server_says_is_printed_escaped(
    job_server: FakeJobServer, capsys: pytest.CaptureFixture[str]
) -> None:
    job_server.jobs["raysubmit_abc"] = _job(
        "raysubmit_abc", message=f"boom{HOSTILE}", metadata={"raytrain_job": f"n{HOSTILE}"}
    )
    job_server.logs = f"\x1b[32mok\x1b[0m\tstep 1\r50%\n{HOSTILE}\n"
    address = ["--address", job_server.address]
    for argv in (["list", *address], ["status", "raysubmit_abc", *address]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x9b" not in out and "\r" not in out, out
        assert "\\x1b]0;pwned\\x07" in out
    assert cli.main(["logs", "raysubmit_abc", *address]) == 0
    out = capsys.readouterr().out
    assert out.startswith("\x1b[32mok\x1b[0m\tstep 1\r50%\n\\x1b]0;pwned\\x07\\x1b[2J")


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ({"raytrain_run_dir": "/runs/r", "raytrain_storage": "{not json"}, "raytrain_storage"),
        (
            {"raytrain_run_dir": "/runs/r", "raytrain_storage": '{"max_attempts": "x"}'},
            "raytrain_storage.max_attempts",
        ),
        (
            {"raytrain_run_dir": "/runs/r", "raytrain_storage": '{"extra": 1}'},
            "raytrain_storage.extra",
        ),
        ({"raytrain_run_dir": "../../etc"}, "raytrain_run_dir"),
        ({"raytrain_run_dir": "/etc/.."}, "raytrain_run_dir"),
        ({"raytrain_run_dir": "s3://user:secret@bucket/r"}, "raytrain_run_dir"),
        ({"raytrain_sweep": "yes"}, "raytrain_sweep"),
    ],
)
def test_malformed_job_metadata_is_one_line_in_status_and_none_for_the_supervisor(
    job_server: FakeJobServer, capsys: pytest.CaptureFixture[str], metadata: dict, key: str
) -> None:
    from raytrain.submit.supervisor import _record

    job_server.jobs["raysubmit_abc"] = _job("raysubmit_abc", metadata=metadata)
    argv = ["status", "raysubmit_abc", "--address", job_server.address]
    for extra in (["--json"], []):
        assert cli.main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: job raysubmit_abc: its metadata {key}: "), err
        assert err.count("\n") == 1 and "secret" not in err
    handle = jobs_client.attach("raysubmit_abc", address=job_server.address)
    assert _record(handle, handle.info()) is None  # the supervisor goes on without it
