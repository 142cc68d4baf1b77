"""The live status record: ``driver.status_record.StatusRecord`` driven event by event with
its own clock, ``run_status``'s reading and wording, and the failure policy's notice of why
workers restart."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from raytrain.contract import FailureNotice
from raytrain.driver.failure_policy import Decision, FailurePolicy, describe_failure
from raytrain.errors import NonFiniteLossError, RunStateError
from raytrain.records.run_status import (
    HEARTBEAT_S,
    STATUS_FILE,
    RunStatus,
    describe,
    read_status,
)
from raytrain.records.status_record import WRITE_EVERY_S, StatusRecord
from raytrain.spec import load_spec
from tests.conftest import digits_spec
from tests.unit.events import report


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record(tmp_path: Path, **trainer: Any) -> tuple[StatusRecord, Clock, list[RunStatus], list]:
    spec = digits_spec(tmp_path, tmp_path, trainer={"max_epochs": 4, **trainer})
    clock, written, committed = Clock(), [], [None]
    record = StatusRecord(
        load_spec(spec),
        attempt=2,
        clock=clock,
        write=lambda text: written.append(RunStatus.model_validate_json(text)),
        committed=lambda: committed[0],
        mlflow_run=lambda: "run-1",
    )
    return record, clock, written, committed


def test_reports_move_the_record_on_with_an_eta_and_writes_are_spaced(tmp_path: Path) -> None:
    record, clock, written, _ = _record(tmp_path, max_steps=100)
    record._save(force=True)
    assert written[-1].state == "starting" and written[-1].total_steps == 100

    record.on_report(report(10, started=0, samples_per_s=320.0))  # a state change: written
    assert (written[-1].state, written[-1].step, written[-1].world_size) == ("training", 10, 2)
    assert written[-1].mlflow_run_id == "run-1" and written[-1].attempt == 2

    clock.now += 1.0
    record.on_report(report(15))  # within WRITE_EVERY_S of the last write: kept, not written
    assert written[-1].step == 10
    clock.now += WRITE_EVERY_S
    record.on_report(report(20, val_loss=0.5, val_acc=0.9))
    last = written[-1]
    assert last.step == 20 and last.val_metrics == {"val_loss": 0.5, "val_acc": 0.9}
    # 10 steps in 3 s since this attempt's first report: 80 left take 24 s
    assert last.eta_s == pytest.approx(24.0) and last.percent == 20.0
    assert last.updated_at == clock.now


def test_the_total_is_learnt_from_the_first_epoch_when_only_epochs_are_set(
    tmp_path: Path,
) -> None:
    record, clock, written, _ = _record(tmp_path)
    record.on_report(report(0, started=0))
    clock.now += 5
    record.on_report(report(45, kind="epoch"))  # 45 steps an epoch, 4 epochs
    assert written[-1].total_steps == 180 and written[-1].epoch == 0


def test_a_checkpoint_is_the_last_one_only_once_ray_committed_it(tmp_path: Path) -> None:
    record, clock, written, committed = _record(tmp_path)
    record.on_report(report(10, started=0))
    clock.now += 1
    record.on_report(report(20, checkpoint=True))
    assert written[-1].state == "checkpointing" and written[-1].last_checkpoint is None
    clock.now += 1
    committed[0] = (10, 0)  # an older one: still pending
    record.on_report(report(21))
    assert record.status.last_checkpoint is None
    committed[0] = (20, 0)
    clock.now += WRITE_EVERY_S
    record.on_report(report(25))
    mark = written[-1].last_checkpoint
    assert written[-1].state == "training" and mark is not None and mark.step == 20


def test_a_restart_carries_the_failure_policys_reason(tmp_path: Path) -> None:
    record, clock, written, committed = _record(tmp_path)
    record.on_report(report(10, started=0))
    clock.now += 1
    committed[0] = (5, 0)  # what Ray Train restores the new group from
    record.on_failure(FailureNotice("RuntimeError: rank 1 lost"))  # the policy's notice: no step
    assert written[-1].state == "restarting" and written[-1].step == 10
    clock.now += 10
    committed[0] = (9, 0)  # the new group trained on and committed before its report came
    # the new group's first report: it restored the checkpoint committed at 5
    record.on_report(report(12, started=5, world_size=1))
    restart = written[-1].restarts[0]
    assert (restart.step, restart.world_size, restart.reason) == (5, 1, "RuntimeError: rank 1 lost")
    assert restart.lost_steps == 5  # reported step 10 before the failure, resumed at 5
    assert written[-1].first_report_at == 1000.0  # the first attempt's first report
    assert written[-1].state == "training" and written[-1].world_size == 1
    # a group that resumed from the in-memory state says so: its step, not storage's
    clock.now += 1
    record.on_failure(FailureNotice("RuntimeError: rank 0 lost"))
    record.on_report(report(16, started=12))
    restart = written[-1].restarts[1]
    assert (restart.step, restart.lost_steps) == (12, 0)


def test_a_hang_is_the_reason_of_the_restart_after_it_and_of_no_later_one(
    tmp_path: Path,
) -> None:
    record, clock, written, _ = _record(tmp_path)
    record.on_report(report(10, started=0))
    record.note_hang("hang at step 11: not in a collective: rank 1 in forward")
    assert written[-1].hang == "hang at step 11: not in a collective: rank 1 in forward"
    record.on_failure(FailureNotice("ActorDiedError: the worker died"))
    record.on_failure(FailureNotice("RuntimeError: the retry failed before it reported"))
    record.on_report(report(12, started=0))
    # the notice of the second failure replaced the first's reason: the hang's is gone
    (restart,) = written[-1].restarts
    assert restart.reason == "RuntimeError: the retry failed before it reported"
    record.note_hang("hang at step 13: ...")
    record.on_failure(FailureNotice("ActorDiedError: the worker died"))
    record.on_report(report(14, started=0))
    assert written[-1].restarts[-1].reason == (
        "hang at step 13: ... (ActorDiedError: the worker died)"
    )
    assert "  last hang: hang at step 13: ..." in describe(written[-1], now=clock.now)


def test_the_last_record_says_how_it_ended_and_a_failing_store_never_stops_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record, clock, written, _ = _record(tmp_path)
    record.on_report(report(10, started=0))
    record.finish("failed", error="TrainingFailed: rank 0: boom")
    assert written[-1].state == "failed" and written[-1].error == "TrainingFailed: rank 0: boom"

    def refuse(text: str) -> None:
        raise OSError("connection refused")

    record._writer._write = refuse
    for step in (11, 12):
        clock.now += WRITE_EVERY_S
        record.on_report(report(step))
    assert capsys.readouterr().err.count("could not be written") == 1


def test_read_status_round_trips_and_names_a_record_it_cannot_read(tmp_path: Path) -> None:
    assert read_status(str(tmp_path)) is None
    status = RunStatus(name="r", state="training", started_at=1.0, updated_at=2.0, driver="h:1")
    (tmp_path / STATUS_FILE).write_text(status.to_json())
    assert read_status(str(tmp_path)) == status
    for bad in (
        "{",
        json.dumps({**status.model_dump(), "state": "dancing"}),
        json.dumps({**status.model_dump(), "extra": 1}),
    ):
        (tmp_path / STATUS_FILE).write_text(bad)
        with pytest.raises(RunStateError, match=f"{STATUS_FILE}: the run's status record"):
            read_status(str(tmp_path))


def test_a_record_that_is_not_a_file_or_too_large_or_not_utf8_is_refused_unread(
    tmp_path: Path,
) -> None:
    """The one reader (``storage.read_text``): a FIFO (whose open would wait for a writer),
    a link to ``/dev/zero`` (endless), a folder, a file over the cap, bytes that are not
    UTF-8 are each a ``StorageError`` naming the record, and none hangs."""
    from raytrain import storage
    from raytrain.errors import StorageError

    cases = {
        "fifo": "is a FIFO",
        "zero": "is a device",
        "folder": "is a folder",
        "latin1": "not UTF-8 text (byte 13 is not)",
    }
    for name in cases:
        (tmp_path / name).mkdir()
    os.mkfifo(tmp_path / "fifo" / STATUS_FILE)
    (tmp_path / "zero" / STATUS_FILE).symlink_to("/dev/zero")
    (tmp_path / "folder" / STATUS_FILE).mkdir()
    (tmp_path / "latin1" / STATUS_FILE).write_bytes('{"name": "caf\xe9"}'.encode("latin-1"))
    for name, why in cases.items():
        with pytest.raises(StorageError, match=f"{name}/{STATUS_FILE}: {re.escape(why)}"):
            read_status(str(tmp_path / name))
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / STATUS_FILE).write_text("x" * 101)
    with pytest.raises(StorageError, match="larger than 100 bytes"):
        storage.read_text(str(tmp_path / "big" / STATUS_FILE), max_bytes=100)
    assert storage.read_text(str(tmp_path / "big" / STATUS_FILE), max_bytes=101) == "x" * 101


def test_a_run_name_with_storage_stays_under_the_storage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``status NAME --storage S`` reads ``S/NAME`` only: a NAME that would lead out of it
    (``../x``, an absolute path) is refused by the spec's own name rule, before any read."""
    from raytrain.cli import app as cli

    outside = tmp_path / "outside"
    outside.mkdir()
    status = RunStatus(name="x", state="training", started_at=1.0, updated_at=2.0, driver="h:1")
    (outside / STATUS_FILE).write_text(status.to_json())
    storage_root = tmp_path / "runs"
    storage_root.mkdir()
    for name in ("../outside", str(outside), "a/../../outside", "a..b", ""):
        assert cli.main(["status", name, "--storage", str(storage_root)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: NAME {name[:80]!r}") and err.count("\n") == 1, err
        assert "cannot name files" in err


def test_describe_shows_progress_eta_and_a_driver_that_stopped_writing() -> None:
    status = RunStatus(
        name="r",
        state="training",
        started_at=0.0,
        updated_at=100.0,
        driver="h:1",
        step=20,
        total_steps=100,
        epoch=1,
        max_epochs=4,
        samples_per_s=300.0,
        eta_s=80.0,
        val_metrics={"val_acc": 0.91},
    )
    lines = describe(status, now=110.0)
    assert lines[0] == "r: training (record 0:10 old)"
    assert "  progress: step 20/100 (20.0%), epoch 2/4" in lines
    assert "  speed: 300 samples/s, ETA 1:10" in lines  # the ETA counts down with the age
    assert "  last validation: val_acc 0.91" in lines
    stale = describe(status, now=100.0 + 3 * HEARTBEAT_S + 1)
    assert stale[0].endswith("old; the driver may have died)")


def test_the_failure_policy_tells_why_and_a_notice_that_fails_changes_nothing() -> None:
    told: list[str] = []
    policy = FailurePolicy(max_preemptions=0, notify=told.append)
    assert policy.decide([RuntimeError("boom\nmore"), RuntimeError("boom")]) == Decision.DEFER
    assert policy.decide([]) == Decision.DEFER
    assert told == ["RuntimeError: boom", describe_failure([])]
    assert "killed" in told[1]

    def broken(text: str) -> None:
        raise ConnectionError("sink gone")

    nan = FailurePolicy(max_preemptions=0, notify=broken)
    assert nan.decide([NonFiniteLossError("loss is nan")]) == Decision.RAISE
