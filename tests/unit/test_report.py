"""``raytrain report`` and ``raytrain doctor`` against what can go wrong around them: output
paths that cannot be written (checked before anything is fetched), a run name matplotlib
would read as mathtext, and a tracking server that is not there or never answers (exit 1,
said at once, not after MLflow's minutes of retries)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from raytrain.cli import app as cli
from raytrain.records.run_status import STATUS_FILE, RunStatus
from raytrain.tracking.mlflow_tracker import READ_SETTINGS
from raytrain.tracking.report import Curve, plot


@pytest.fixture
def closed_port() -> int:
    """A loopback port free now, with nothing listening: a connection is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that takes connections (the kernel's backlog) and never answers."""
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        yield int(hole.getsockname()[1])


def _one_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def test_output_paths_are_checked_before_anything_is_fetched(
    tmp_path: Path, closed_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Against a server that is not there, each bad path is exit 2 naming its flag, not
    exit 1 for the server: the paths were checked first. Nothing is written."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.txt").write_text("a file")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    unwritable = next((p for p in (locked, Path("/proc/1")) if not os.access(p, os.W_OK)), None)
    ok = str(tmp_path / "r.png")
    cases = [
        (["--out", str(tmp_path / "folder")], "--out "),
        (["--out", str(tmp_path / "notes.txt" / "r.png")], "--out "),
        (["--out", ok, "--html", str(tmp_path / "folder")], "--html "),
        (["--out", ok, "--html", str(tmp_path / "notes.txt" / "r.html")], "--html "),
        (["--out", ok, "--html", ok], "--html "),
    ]
    if unwritable is not None:  # as root, a folder's mode does not stop a write
        cases.append((["--out", str(unwritable / "r.png")], "--out "))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for flags, flag in cases:
        argv = ["report", "abc", "--tracking-uri", f"http://127.0.0.1:{closed_port}", *flags]
        assert cli.main(argv) == 2, flags
        assert _one_error(capsys).startswith(f"error: {flag}"), flags
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_run_name_that_looks_like_mathtext_is_plotted_as_text() -> None:
    png = plot(
        {
            "loss": [Curve("$\\foo$ (abc12345)", "loss", [1, 2], [1.0, 0.5])],
            "metrics": [Curve("$x^$ (abc12345)", "val_$\\frac{$", [1], [0.5])],
        }
    )
    assert png.startswith(b"\x89PNG")


def _record_with_run(root: Path) -> None:
    status = RunStatus(
        name="r",
        state="finished",
        started_at=1.0,
        updated_at=2.0,
        driver="h:1",
        mlflow_run_id="0123456789abcdef",
    )
    (root / "r").mkdir()
    (root / "r" / STATUS_FILE).write_text(status.to_json())


def test_a_tracking_server_that_is_not_there_is_exit_1_and_named(
    tmp_path: Path, closed_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    _record_with_run(tmp_path)
    settings = {name: os.environ.get(name) for name in READ_SETTINGS}
    uri = f"http://user:hunter2@127.0.0.1:{closed_port}"
    expected = (
        f"error: cannot reach the tracking server at http://***@127.0.0.1:{closed_port}"
        " (the connection was refused)"
    )
    for argv in (
        ["report", "abc", "--tracking-uri", uri, "--out", str(tmp_path / "r.png")],
        ["doctor", "r", "--storage", str(tmp_path), "--tracking-uri", uri],
    ):
        assert cli.main(argv) == 1, argv
        assert _one_error(capsys).startswith(expected)
    assert not (tmp_path / "r.png").exists()
    assert {name: os.environ.get(name) for name in READ_SETTINGS} == settings  # for this only


def test_a_tracking_server_that_never_answers_is_given_up_on(
    tmp_path: Path, silent_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server that takes the connection and says nothing: MLflow's own settings would wait
    120 s a request, 7 times with backoff; doctor's wait 5 s, twice."""
    _record_with_run(tmp_path)
    uri = f"http://127.0.0.1:{silent_port}"
    argv = ["doctor", "r", "--storage", str(tmp_path), "--tracking-uri", uri]
    assert cli.main(argv) == 1
    assert _one_error(capsys) == (
        f"error: cannot reach the tracking server at {uri} (no answer "
        "within 5 s); is it up, and is this its address?"
    )


def test_a_store_that_is_no_mlflow_store_is_exit_2_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file that is no database, or a folder, as the store: MLflow's (or SQLAlchemy's)
    error was a traceback, exit 1. Nothing is written to it."""
    _record_with_run(tmp_path)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"\x00\xff not a database \xfe" * 64)
    before = junk.read_bytes()
    for uri in (f"sqlite:///{junk}", str(tmp_path / "r")):
        for argv in (
            ["report", "abc", "--tracking-uri", uri, "--out", str(tmp_path / "r.png")],
            ["doctor", "r", "--storage", str(tmp_path), "--tracking-uri", uri],
        ):
            assert cli.main(argv) == 2, argv
            assert _one_error(capsys).startswith(f"error: --tracking-uri: {uri} is not an "), argv
    assert junk.read_bytes() == before
    assert not (tmp_path / "r.png").exists()
