"""The record of ``raytrain up``'s cluster, and the ``up``/``down`` commands' answers that
need no cluster: what a stale record means, who may read it, and bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain.cli.app import main
from raytrain.driver import cluster_record
from raytrain.driver.cluster_record import ClusterRecord
from raytrain.driver.ray_runtime import RayHandle


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(cluster_record.HOME_ENV, str(tmp_path))
    return tmp_path


def _record(pid: int) -> ClusterRecord:
    return ClusterRecord(
        pid=pid,
        address="127.0.0.1:6379",
        num_cpus=4,
        num_gpus=0,
        warm=7,
        embedded_env={"RAY_AUTH_MODE": "token"},
        started_at=0.0,
    )


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_record_counts_only_while_its_server_holds_the_lock(home: Path) -> None:
    assert cluster_record.running() is None  # never up
    live = _record(os.getpid())
    cluster_record.write_record(live)
    assert cluster_record.running() is None  # no server holds the lock: stale
    held = cluster_record.lock(cluster_record.LOCK_NAME, wait=False)
    assert held is not None
    try:
        assert cluster_record.running() == live
        assert cluster_record.lock(cluster_record.LOCK_NAME, wait=False) is None  # one server
        cluster_record.write_record(_record(_dead_pid()))
        assert cluster_record.running() is None  # the lock's holder is not the record's pid
        assert (home / cluster_record.RECORD_NAME).stat().st_mode & 0o777 == 0o600
        (home / cluster_record.RECORD_NAME).write_text("{not json")
        assert cluster_record.running() is None
    finally:
        os.close(held)
    cluster_record.write_record(live)
    assert cluster_record.running() is None  # the server died: its lock went with it


def test_a_server_removes_only_its_own_record(home: Path) -> None:
    cluster_record.write_record(_record(123))
    cluster_record.remove_record(456)  # another server's: kept
    assert json.loads((home / cluster_record.RECORD_NAME).read_text())["pid"] == 123
    cluster_record.remove_record(123)
    assert not (home / cluster_record.RECORD_NAME).exists()


def test_a_home_that_is_a_file_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(cluster_record.HOME_ENV, str(tmp_path / "file"))
    assert main(["up"]) == 2
    err = capsys.readouterr().err
    assert "RAYTRAIN_HOME" in err and str(tmp_path / "file") in err and "Traceback" not in err


def test_down_and_status_with_nothing_up(home: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["down"]) == 0
    assert capsys.readouterr().out.strip() == "raytrain: no cluster is up"
    assert main(["up", "--status"]) == 1
    assert "no cluster is up" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--num-cpus", "0"], "--num-cpus 0"),
        (["--num-gpus", "-1"], "--num-gpus -1"),
        (["--warm", "-2"], "--warm -2"),
        # past Ray's limit: the server started, then failed with a traceback (exit 1)
        (["--num-cpus", str(10**20)], f"--num-cpus {10**20}: must be at most"),
        (["--num-gpus", str(10**15)], f"--num-gpus {10**15}: must be at most"),
    ],
)
def test_bad_up_flags_are_refused_by_name(
    home: Path, capsys: pytest.CaptureFixture, flags: list[str], named: str
) -> None:
    assert main(["up", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err
    assert not (home / cluster_record.RECORD_NAME).exists()  # nothing started


def test_only_a_cluster_started_here_ends_with_the_run() -> None:
    assert RayHandle(started_here=True, address=None, embedded_env={}).ends_with_run
    joined_up = RayHandle(started_here=True, address="h:1", embedded_env={})
    assert not joined_up.ends_with_run
    assert not RayHandle(started_here=True, address="h:1").ends_with_run  # RAY_ADDRESS
    assert not RayHandle(started_here=False, address=None, embedded_env={}).ends_with_run


def test_a_damaged_record_of_a_live_server_is_named_not_taken_for_none(
    home: Path, capsys: pytest.CaptureFixture
) -> None:
    """cluster.json damaged while its server runs: ``down`` said no cluster was up (exit 0,
    the server left running), ``up --status`` the same, and ``up`` started a second server
    that failed on the lock, its log replacing the live server's."""
    (home / cluster_record.RECORD_NAME).write_text("{not json")
    log = home / cluster_record.LOG_NAME
    log.write_text("raytrain: cluster up at 127.0.0.1:6379 (pid 123): 4 CPU(s)\n")
    held = cluster_record.lock(cluster_record.LOCK_NAME, wait=False)  # the live server
    assert held is not None
    try:
        for argv in (["down"], ["up", "--status"], ["up", "--num-cpus", "2"]):
            assert main(argv) == 2, argv
            captured = capsys.readouterr()
            lines = captured.err.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in captured.err, argv
            assert lines[0].startswith(f"error: {home / cluster_record.RECORD_NAME}: "), argv
            assert str(log) in lines[0] and "no cluster is up" not in captured.out
        starting = cluster_record.lock(cluster_record.UP_LOCK_NAME, wait=False)
        assert starting is not None
        try:  # an `up` under way replaces the record: nothing is lost
            assert cluster_record.lost_record() is None
        finally:
            os.close(starting)
    finally:
        os.close(held)
    assert log.read_text().startswith("raytrain: cluster up at 127.0.0.1:6379 (pid 123)")
    assert main(["down"]) == 0  # the server gone: the damaged record is a stale one
    assert "no cluster is up" in capsys.readouterr().out
