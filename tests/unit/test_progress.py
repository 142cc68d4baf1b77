"""The driver's progress line, fed the events rank 0 sends."""

from __future__ import annotations

import io
import math

import pytest

from raytrain.contract import (
    Event,
    FailureNotice,
    HangReport,
    RollbackNotice,
    RunListener,
    TimelineWindow,
    deliver,
)
from raytrain.driver.progress import Latest, ProgressLine
from tests.unit.events import report


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_line_shows_epoch_step_metrics_and_eta() -> None:
    out = io.StringIO()
    line = ProgressLine(max_epochs=4, max_steps=-1, stream=out)
    line.on_report(report(5, train_loss=2.0, samples_per_s=100.0))
    line.on_report(report(10, kind="epoch", train_loss=1.5, val_acc=0.5, samples_per_s=120.0))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # not a tty: the first line, then every epoch end
    last = lines[-1]
    assert last.startswith("epoch 1/4 | step 10 | train_loss 1.5000 | val_acc 0.5000")
    assert "120 samples/s" in last
    assert "ETA" in last  # 10 steps per epoch are known now: 30 to go


def test_non_finite_values_are_not_shown() -> None:
    out = io.StringIO()
    ProgressLine(max_epochs=1, max_steps=-1, stream=out).on_report(
        report(3, kind="epoch", val_acc=-math.inf)
    )
    assert "val_acc" not in out.getvalue()


def test_terminal_redraws_one_line_in_place() -> None:
    out = _Tty()
    line = ProgressLine(max_epochs=None, max_steps=100, stream=out)
    for step in (10, 20, 30):
        line.on_report(report(step, train_loss=1.0))
    line.close()
    text = out.getvalue()
    assert text.count("\r") == 3
    assert text.count("\n") == 1
    assert "step 30" in text.split("\r")[-1]


def test_the_sink_measures_the_mean_time_between_failures() -> None:
    """What ``checkpoint.every_n_steps: auto`` asks the driver: this driver's time over the
    worker-group failures the failure policy noticed; none before the first."""
    import time

    from raytrain.driver.progress import MetricsSink

    sink = MetricsSink()
    sink.put(report(3))
    assert sink.mtbf() is None
    began = time.time()
    sink.put(FailureNotice("worker 1 died"))
    sink.put(FailureNotice("worker 0 died"))
    mtbf = sink.mtbf()
    assert mtbf is not None and 0 < mtbf <= (time.time() - began) / 2 + (began - sink._started)


class _Heard(RunListener):
    """Notes each event it hears by the method that heard it."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, object]] = []

    def on_report(self, report: object) -> None:
        self.heard.append(("report", report))

    def on_timeline(self, window: object) -> None:
        self.heard.append(("timeline", window))

    def on_hang(self, report: object) -> None:
        self.heard.append(("hang", report))

    def on_rollback(self, notice: object) -> None:
        self.heard.append(("rollback", notice))

    def on_failure(self, notice: object) -> None:
        self.heard.append(("failure", notice))


def test_every_event_reaches_the_listeners_method_for_its_type() -> None:
    """The driver dispatches by type (``contract.deliver``), not by a key in a dict: each
    event type reaches its own method, a listener that does not override one ignores it,
    and anything else (a dict, as events once were) is refused."""
    events: list[Event] = [
        report(3, train_loss=1.0),
        TimelineWindow(rank=1, node="n", step=3, world_size=2, parts={"busy": [0.1, 0.2, 0.1]}),
        HangReport(1, 2, "n", 9, 3, "training", 70.0, 60.0, None, "t", "s", 0.0),
        RollbackNotice(step=3, rollbacks=()),
        FailureNotice("worker 1 died"),
    ]
    heard, quiet = _Heard(), RunListener()
    for event in events:
        deliver(event, heard)
        deliver(event, quiet)
    assert heard.heard == list(
        zip(["report", "timeline", "hang", "rollback", "failure"], events, strict=True)
    )
    with pytest.raises(TypeError, match="not a run event: dict"):
        deliver({"step": 3}, heard)  # type: ignore[arg-type]


def test_latest_keeps_the_newest_numbers_startup_and_stop() -> None:
    latest = Latest()
    latest.on_report(report(4, train_loss=2.0, val_acc=0.5, started=0))
    latest.on_report(report(8, epoch=1, train_loss=1.0, started=6))
    latest.on_report(report(9, epoch=1, kind="stopped", stopped="EarlyStopping: no progress"))
    assert latest.values == {
        "train_loss": 1.0,
        "val_acc": 0.5,
        "step": 9,
        "epoch": 1,
        "world_size": 2,
    }
    assert latest.startup is not None and latest.startup.resumed_step == 6
    assert latest.stopped == "EarlyStopping: no progress"
