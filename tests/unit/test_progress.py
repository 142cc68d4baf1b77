"""The driver's progress line, fed the events rank 0 sends."""

from __future__ import annotations

import io
import math

from raytrain.driver.progress import ProgressLine


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_line_shows_epoch_step_metrics_and_eta() -> None:
    out = io.StringIO()
    line = ProgressLine(max_epochs=4, max_steps=-1, stream=out)
    line({"kind": "step", "step": 5, "epoch": 0, "train_loss": 2.0, "samples_per_s": 100.0})
    line(
        {
            "kind": "epoch",
            "step": 10,
            "epoch": 0,
            "train_loss": 1.5,
            "val_acc": 0.5,
            "samples_per_s": 120.0,
        }
    )
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # not a tty: the first line, then every epoch end
    last = lines[-1]
    assert last.startswith("epoch 1/4 | step 10 | train_loss 1.5000 | val_acc 0.5000")
    assert "120 samples/s" in last
    assert "ETA" in last  # 10 steps per epoch are known now: 30 to go


def test_non_finite_values_are_not_shown() -> None:
    out = io.StringIO()
    ProgressLine(max_epochs=1, max_steps=-1, stream=out)(
        {"kind": "epoch", "step": 3, "epoch": 0, "val_acc": -math.inf}
    )
    assert "val_acc" not in out.getvalue()


def test_terminal_redraws_one_line_in_place() -> None:
    out = _Tty()
    line = ProgressLine(max_epochs=None, max_steps=100, stream=out)
    for step in (10, 20, 30):
        line({"kind": "step", "step": step, "epoch": 0, "train_loss": 1.0})
    line.close()
    text = out.getvalue()
    assert text.count("\r") == 3
    assert text.count("\n") == 1
    assert "step 30" in text.split("\r")[-1]


def test_the_sink_measures_the_mean_time_between_failures() -> None:
    """What ``checkpoint.every_n_steps: auto`` asks the driver: this driver's time over the
    worker-group failures the failure policy noticed; none before the first."""
    import time

    from raytrain.checkpoints.layout import FAILURE_KEY
    from raytrain.driver.progress import MetricsSink

    sink = MetricsSink()
    sink.put({"step": 3})
    assert sink.mtbf() is None
    began = time.time()
    sink.put({FAILURE_KEY: "worker 1 died"})
    sink.put({FAILURE_KEY: "worker 0 died"})
    mtbf = sink.mtbf()
    assert mtbf is not None and 0 < mtbf <= (time.time() - began) / 2 + (began - sink._started)
