"""What ``raytrain submit`` decides before it talks to a cluster: the address, the token,
the job's command, and the input it refuses (each with exit code 2 and nothing sent)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from raytrain.cli import app as cli
from raytrain.submit import client as jobs_client
from raytrain.submit import connection
from raytrain.submit.connection import JobsError, resolve_address, resolve_token
from tests.conftest import digits_spec, write_spec

# A loopback port nothing listens on: connecting there fails at once.
CLOSED = "http://127.0.0.1:9"


@pytest.fixture
def no_ray_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN",
                 "RAY_AUTH_TOKEN_PATH"):  # fmt: skip
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
    command = jobs_client.entrypoint("jobs/a b.yaml", ["tracking.mlflow.tags={k: 'v w'}"],
                                     ["--fresh"])  # fmt: skip
    assert shlex.split(command) == ["python", "-m", "raytrain", "run", "jobs/a b.yaml",
                                    "tracking.mlflow.tags={k: 'v w'}", "--fresh"]  # fmt: skip


def test_a_sweep_is_submitted_as_raytrain_tune() -> None:
    command = jobs_client.entrypoint("sweep.yaml", [], ["--fresh"], "tune")
    assert shlex.split(command) == ["python", "-m", "raytrain", "tune", "sweep.yaml", "--fresh"]


def test_status_lines_of_a_sweep_are_its_trials() -> None:
    from raytrain.cli.jobs import sweep_lines

    logs = (
        "raytrain: sweep s: 2 sample(s)\nraytrain: trial s-000 finished after 1 epoch(s): "
        "val_acc 0.9 (lr=0.01)\nother\nraytrain: trial s-001 stopped after 1 epoch(s)\n"
    )
    assert sweep_lines(logs) == ["s-000 finished after 1 epoch(s): val_acc 0.9 (lr=0.01)",
                                 "s-001 stopped after 1 epoch(s)"]  # fmt: skip


def _spec(tmp_path: Path, digits_dir: Path) -> Path:
    wd = tmp_path / "wd"
    wd.mkdir()
    return write_spec(wd / "spec.yaml", digits_spec(digits_dir, tmp_path))


def test_bad_input_is_refused_before_anything_is_sent(
    no_ray_env: Path, digits_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = _spec(no_ray_env, digits_dir)
    cases = [
        (["submit", str(spec), "--address", CLOSED, "--working-dir", str(no_ray_env / "x")],
         "--working-dir .*: not a directory"),
        (["submit", str(spec), "--address", CLOSED, "--working-dir", str(digits_dir)],
         "the spec is outside the working directory"),
        (["submit", str(spec), "trainer.max_epochs=0", "--address", CLOSED,
          "--working-dir", str(spec.parent)], "trainer.max_epochs"),
        (["submit", str(spec), "--address", CLOSED, "--working-dir", str(spec.parent),
          "--env", "RAY_AUTH_TOKEN=abc"], "--env RAY_AUTH_TOKEN"),
        (["submit", str(spec), "--address", CLOSED, "--working-dir", str(spec.parent),
          "--env", "A=1", "--env", "NOEQUALS"], "--env #2: expected KEY=VALUE"),
        (["status", "raysubmit_x"], "no cluster address"),
    ]  # fmt: skip
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

    job = load_spec({"name": "w", "model": {"class_path": "m:M"},
                     "data": {"train": {"uri": "s3://b/train"}}})  # fmt: skip
    notes = jobs_client._warnings(job, {"MLFLOW_TRACKING_PASSWORD": "x", "LOG_LEVEL": "info"})
    assert any(n.startswith("--env MLFLOW_TRACKING_PASSWORD:") for n in notes)
    assert not any("LOG_LEVEL" in n for n in notes)
    assert any(n.startswith("checkpoint.storage 'runs' is a relative path") for n in notes)
    assert any("MLflow record lands in the job's working dir" in n for n in notes)
