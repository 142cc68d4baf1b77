"""A run folder's safety without Ray: which uncommitted checkpoint folders may be deleted,
the lease that keeps two live runs out of one folder, and the best checkpoint's choice when
the monitored metric never arrives."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from raytrain.checkpoints.layout import SNAPSHOT_FILE, uncommitted
from raytrain.contract import SCORE_KEY
from raytrain.errors import RunStateError, StorageError
from raytrain.records import lease
from tests.unit.events import report

OLD, LATEST, NEWER = (f"checkpoint_2026-12-02_03-{m}-00.000000" for m in ("10", "20", "30"))


def _snapshot(run: Path, committed: list[str], latest: str | None) -> None:
    def result(name: str) -> dict[str, Any]:
        return {"checkpoint_dir_name": name, "metrics": {"step": 10}}

    tree = {
        "checkpoint_results": [result(n) for n in committed],
        "latest_checkpoint_result": result(latest) if latest else None,
    }
    (run / SNAPSHOT_FILE).write_text(json.dumps(tree))


def _folders(run: Path, *names: str) -> None:
    for name in names:
        (run / name).mkdir(parents=True)
        (run / name / "checkpoint.ckpt").write_bytes(b"x")


def test_only_folders_newer_than_the_latest_commit_are_partial(tmp_path: Path) -> None:
    _folders(tmp_path, OLD, LATEST, NEWER, "checkpoint_000001")
    # OLD was committed once, but this snapshot no longer lists it; a non-Ray name is kept
    _snapshot(tmp_path, [LATEST], LATEST)
    left = uncommitted(str(tmp_path))
    assert left.partial == [str(tmp_path / NEWER)]
    assert sorted(left.kept) == sorted([str(tmp_path / OLD), str(tmp_path / "checkpoint_000001")])
    assert left.why


@pytest.mark.parametrize("snapshot", [None, "listing nothing"])
def test_no_snapshot_or_an_empty_one_deletes_nothing(tmp_path: Path, snapshot: str | None) -> None:
    _folders(tmp_path, OLD, NEWER)
    if snapshot:
        _snapshot(tmp_path, [], None)
    left = uncommitted(str(tmp_path))
    assert left.partial == []
    assert len(left.kept) == 2
    assert SNAPSHOT_FILE in (left.why or "")


@pytest.mark.parametrize("text", ["", '{"checkpoint_results": [', "{}", "[1, 2]", "null"])
def test_an_unreadable_snapshot_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    _folders(tmp_path, OLD)
    (tmp_path / SNAPSHOT_FILE).write_text(text)
    with pytest.raises(StorageError, match=f"{SNAPSHOT_FILE}: Ray Train's checkpoint snapshot"):
        uncommitted(str(tmp_path))
    assert (tmp_path / OLD).exists()


_DEEP = "[" * 100_000 + "]" * 100_000


def _odd_snapshot(latest: Any, metrics: Any) -> str:
    result = {"checkpoint_dir_name": latest, "metrics": metrics}
    return json.dumps({"checkpoint_results": [result], "latest_checkpoint_result": result})


@pytest.mark.parametrize(
    "text",
    [
        _DEEP,  # a RecursionError traceback before
        _odd_snapshot("../../elsewhere", {"step": 1}),  # resumed from outside the run folder
        _odd_snapshot("checkpoint_1/../../x", {"step": 1}),
        _odd_snapshot(["checkpoint_1"], {"step": 1}),
        _odd_snapshot(LATEST, {"epoch": "one", "step": 1}),  # int() of it in the driver
        _odd_snapshot(LATEST, {"epoch": 1e400, "step": 1}),  # int(inf): OverflowError
        _odd_snapshot(LATEST, {"epoch": 1, "step": True}),
    ],
    ids=["deep", "dotdot", "inner-dotdot", "list", "epoch-str", "epoch-inf", "step-bool"],
)
def test_a_snapshot_of_odd_shape_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    from raytrain.checkpoints.layout import latest_committed

    _folders(tmp_path, OLD, NEWER)
    (tmp_path / SNAPSHOT_FILE).write_text(text)
    for read in (uncommitted, latest_committed):
        with pytest.raises(StorageError, match=f"{SNAPSHOT_FILE}: Ray Train's checkpoint"):
            read(str(tmp_path))
    assert (tmp_path / OLD).exists() and (tmp_path / NEWER).exists()


def test_a_forced_takeover_deletes_no_upload_of_the_run_it_displaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from raytrain.records.run_folder import drop_uncommitted
    from raytrain.spec import parse_spec
    from tests.conftest import digits_spec

    job = parse_spec(digits_spec(tmp_path, tmp_path))
    run = tmp_path / "runs" / job.name
    _folders(run, LATEST, NEWER)
    _snapshot(run, [LATEST], LATEST)
    held = lease.Lease(str(run))
    held.displaced = _holder(pid=os.getpid())
    drop_uncommitted(job, held)
    assert (run / NEWER).exists()
    assert "may still be uploading" in capsys.readouterr().err
    held.displaced = None
    drop_uncommitted(job, held)
    assert not (run / NEWER).exists() and (run / LATEST).exists()


def _holder(**fields: Any) -> lease.Holder:
    now = time.time()
    base = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": now,
        "heartbeat_at": now,
        "token": "other",
    }
    return lease.Holder(**{**base, **fields})


def _write_lease(run: Path, holder: lease.Holder) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / lease.LEASE_FILE).write_text(json.dumps(holder.__dict__))


@pytest.fixture
def other_process() -> Any:
    """A live process that is not this one: the holder of another run's lease."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    yield proc
    proc.stdin.close()
    proc.wait(timeout=30)


def test_a_live_lease_refuses_a_second_run_naming_its_holder(
    tmp_path: Path, other_process: Any
) -> None:
    run = tmp_path / "run"
    _write_lease(run, _holder(pid=other_process.pid))
    before = (run / lease.LEASE_FILE).read_text()
    for attempt in (lambda: lease.check_free(str(run)), lambda: lease.Lease(str(run)).acquire()):
        with pytest.raises(RunStateError, match=f"pid {other_process.pid} on .*--force"):
            attempt()
    assert (run / lease.LEASE_FILE).read_text() == before  # the holder's lease is untouched


def test_force_takes_a_live_lease_and_the_holder_sees_it_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    first = lease.Lease(str(run)).acquire()
    lost: list[lease.Holder] = []
    first.on_lost = lost.append
    assert first.beat() is True  # still its own
    second = lease.Lease(str(run)).acquire(force=True)
    assert second.displaced is not None and second.displaced.token == first.holder.token
    assert "--force: taking over" in capsys.readouterr().err
    assert first.beat() is False
    assert lost and lost[0].token == second.holder.token
    first.release()  # not its lease any more: left alone
    assert lease.read_holder(str(run)) == second.holder
    second.release()
    assert not (run / lease.LEASE_FILE).exists()


@pytest.mark.parametrize(
    "stale",
    [
        {"heartbeat_at": time.time() - lease.STALE_S - 5, "host": "elsewhere"},  # no heartbeat
        {"pid": 2**22 + 12345},  # a process of this host that does not exist
        # values no live run could have written
        {"pid": 10**30},  # os.kill: OverflowError traceback before
        {"host": "elsewhere", "started_at": float("nan")},  # localtime(nan): ValueError
        {"host": "elsewhere", "started_at": 1e300},  # localtime: OverflowError
        {"host": "elsewhere", "heartbeat_at": float("inf")},  # never stale, without end
        {"host": "elsewhere", "heartbeat_at": float("nan")},
        {"host": "elsewhere", "heartbeat_at": time.time() + 10**8},  # stale in three years
    ],
    ids=[
        "no-heartbeat",
        "dead-pid",
        "huge-pid",
        "nan-start",
        "huge-start",
        "inf-beat",
        "nan-beat",
        "future-beat",
    ],
)
def test_a_stale_lease_is_taken_over_with_a_warning(
    tmp_path: Path, stale: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    _write_lease(run, _holder(**stale))
    lease.check_free(str(run))
    held = lease.Lease(str(run)).acquire()
    assert "taking over the stale lease" in capsys.readouterr().err
    assert lease.read_holder(str(run)) == held.holder
    held.release()


def test_a_corrupt_lease_counts_as_stale(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / lease.LEASE_FILE).write_text('{"host": "x", "pid":')
    held = lease.Lease(str(run)).acquire()
    assert lease.read_holder(str(run)) == held.holder
    held.release()


def test_a_deeply_nested_lease_counts_as_stale(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / lease.LEASE_FILE).write_text(_DEEP)
    lease.check_free(str(run))
    lease.Lease(str(run)).acquire().release()


@pytest.mark.parametrize(("sub", "says"), [("", "is a file"), ("job", "under")])
def test_a_run_folder_that_is_a_file_is_refused_before_anything_starts(
    tmp_path: Path, sub: str, says: str
) -> None:
    """It passed every check before Ray; the lease then failed with FileExistsError."""
    (tmp_path / "runs").write_text("notes")
    run = tmp_path / "runs" / sub if sub else tmp_path / "runs"
    with pytest.raises(RunStateError, match=f"name: {run}: the run's folder .*{says}"):
        lease.check_free(str(run))
    with pytest.raises(RunStateError, match=f"name: {run}: the run's folder .*{says}"):
        lease.Lease(str(run)).acquire()
    assert (tmp_path / "runs").read_text() == "notes"


def test_a_run_that_wrote_nothing_leaves_no_folder(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "job"
    held = lease.Lease(str(run)).acquire()
    assert (run / lease.LEASE_FILE).exists()
    held.release()
    assert not run.exists()


def _entries(*scores: float | None) -> list[tuple[str, dict[str, Any]]]:
    return [(f"ckpt{i}", {} if s is None else {SCORE_KEY: s}) for i, s in enumerate(scores)]


def test_best_checkpoint_by_score_newest_of_equals_recency_without_a_score() -> None:
    from raytrain.driver.results import best_of

    # Ray's order: worst first, equal scores in report order
    assert best_of(_entries(0.1, 0.5, 0.9), "val_acc", "max") == "ckpt2"
    assert best_of(_entries(0.9, 0.5, 0.5), "val_loss", "min") == "ckpt2"
    # the monitored metric never reported: every score is the worst; the newest is best
    assert best_of(_entries(float("inf"), float("inf"), float("inf")), "nope", "min") == "ckpt2"
    assert best_of(_entries(-float("inf"), -float("inf")), "nope", "max") == "ckpt1"
    # unscored checkpoints never beat a scored one
    assert best_of(_entries(float("inf"), 0.3), "val_loss", "min") == "ckpt1"
    assert best_of(_entries(None, None), None, "min") == "ckpt1"


def test_monitor_missing_is_judged_once_a_validation_reported() -> None:
    from raytrain.worker.reporting import monitor_missing

    assert monitor_missing("val_acc", {"train_loss": 1.0}, validated=False) is None
    assert monitor_missing("train_loss", {"train_loss": 1.0}, validated=False) == []
    assert monitor_missing("val_acc", {"val_acc": 0.5}, validated=True) == []
    got = monitor_missing("val_accuracy", {"val_acc": 0.5, "train_loss": 1.0, "_x": 1}, True)
    assert got == ["train_loss", "val_acc"]


class _Tracker:
    """What RunRecord needs of an MLflow tracker: a plain recorder."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}
        self.metrics: list[tuple[dict[str, Any], int]] = []

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self.metrics.append((metrics, step))


def test_the_driver_warns_and_tags_the_run_when_the_monitor_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from raytrain.contract import Report
    from raytrain.driver.background import Background
    from raytrain.driver.run_record import RunRecord
    from raytrain.spec import parse_spec
    from tests.conftest import digits_spec

    job = parse_spec(
        digits_spec(
            tmp_path,
            tmp_path,
            checkpoint={
                "storage": str(tmp_path / "runs"),
                "monitor": "val_accuracy",
                "mode": "max",
            },
        )
    )
    record = RunRecord(job, None)
    tracker = _Tracker()
    record._opening = Background(lambda: tracker)
    record.on_report(
        Report(
            step=23,
            epoch=0,
            kind="epoch",
            world_size=1,
            metrics={"val_acc": 0.9},
            monitor_missing=("train_loss", "val_acc"),
        )
    )
    err = capsys.readouterr().err
    assert "checkpoint.monitor 'val_accuracy' was not reported" in err
    assert "reported: train_loss, val_acc" in err
    assert "ranked by recency" in tracker.tags["raytrain.checkpoint_ranking"]
    assert tracker.metrics[0][1] == 23


def test_an_unscored_checkpoint_survives_ray_s_snapshot_as_a_number() -> None:
    """Ray Train writes its snapshot through pydantic, which writes an infinite float as
    null; a restored null score fails Ray's ranking at the next checkpoint, forever. The
    reporter's score for a checkpoint before the first validation (and for a NaN metric)
    is the worst finite one, which the same round trip keeps."""
    from pydantic import BaseModel

    from raytrain.checkpoints.layout import UNSCORED, checkpoint_score, real_score
    from raytrain.worker.reporting import Ranking

    class Result(BaseModel):  # Ray's _TrainingResultState: a dict of metrics
        metrics: dict

    for mode in ("max", "min"):
        ranking = Ranking("val_acc", mode)

        def reported(metrics: dict[str, float], ranking: Ranking = ranking) -> dict[str, Any]:
            """A checkpoint's report as Ray gets it (``Report.for_ray``)."""
            score, _ = ranking.rank(metrics, metrics, validated=False)
            return report(3, score=score, **metrics).for_ray()

        before_validation = reported({"train_loss": 1.0})
        nan = reported({"val_acc": float("nan")})
        for ranked in (before_validation, nan):
            back = json.loads(Result(metrics=ranked).model_dump_json())["metrics"]
            assert back[SCORE_KEY] == UNSCORED[mode]
            assert real_score(back[SCORE_KEY]) is None
        scored = reported({"val_acc": 0.5})
        assert json.loads(Result(metrics=scored).model_dump_json())["metrics"][SCORE_KEY] == 0.5
    # every value, finite or not, ranks below every real score, in its mode
    assert checkpoint_score(None, "max") < checkpoint_score(-1e300, "max")
    assert checkpoint_score(float("inf"), "min") > checkpoint_score(1e300, "min")
    assert checkpoint_score(True, "max") == UNSCORED["max"]


def test_a_snapshot_with_null_scores_is_repaired_before_ray_restores_it(tmp_path: Path) -> None:
    """A run whose snapshot an earlier raytrain left with null scores (a step checkpoint
    taken before the first validation, then a lost driver) is resumable again: every null
    becomes the worst finite score, scored results stay as they were, and a snapshot with
    nothing to repair is not rewritten."""
    from raytrain.checkpoints.layout import UNSCORED, read_snapshot, repair_snapshot_scores

    run = tmp_path / "run"
    run.mkdir()

    def result(name: str, score: Any) -> dict[str, Any]:
        return {"checkpoint_dir_name": name, "metrics": {"step": 4, SCORE_KEY: score}}

    tree = {
        "checkpoint_results": [result(OLD, None), result(LATEST, 0.7)],
        "latest_checkpoint_result": result(NEWER, None),
        "pending_training_results": [result(NEWER, None)],
        "ray_version": "2.60.0",
    }
    (run / SNAPSHOT_FILE).write_text(json.dumps(tree))
    assert repair_snapshot_scores(str(run), "max") == 2  # OLD, NEWER
    fixed = json.loads((run / SNAPSHOT_FILE).read_text())
    scores = [r["metrics"][SCORE_KEY] for r in fixed["checkpoint_results"]]
    assert scores == [UNSCORED["max"], 0.7]
    assert fixed["latest_checkpoint_result"]["metrics"][SCORE_KEY] == UNSCORED["max"]
    assert fixed["pending_training_results"][0]["metrics"][SCORE_KEY] == UNSCORED["max"]
    assert fixed["ray_version"] == "2.60.0"
    snapshot = read_snapshot(str(run))
    assert snapshot is not None and snapshot.latest == NEWER
    mtime = (run / SNAPSHOT_FILE).stat().st_mtime_ns
    assert repair_snapshot_scores(str(run), "max") == 0
    assert (run / SNAPSHOT_FILE).stat().st_mtime_ns == mtime
    assert repair_snapshot_scores(str(tmp_path / "none"), "min") == 0
