"""The driver's view of training: one live progress line built from the workers' reports.

Workers report through ``ray.train.report``; ``ReportRelay`` (a Ray Train callback that runs
in the train controller) forwards rank 0's metrics over a Ray queue to the driver, where
``ReportPump`` hands each one to the progress line and to the tracker. One line replaces N
interleaved per-rank Lightning bars.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

try:  # Ray is imported lazily by the CLI; this module is only loaded once it runs.
    from ray.train.v2.api.callback import UserCallback
except ImportError:  # pragma: no cover - Ray Train V1 layout
    from ray.train import UserCallback  # type: ignore[attr-defined, no-redef]


class ReportRelay(UserCallback):
    """Runs in the train controller; puts each report's rank-0 metrics on ``queue``."""

    def __init__(self, queue: Any):
        self.queue = queue

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any):
        if not metrics:
            return
        event = dict(metrics[0])
        if checkpoint is not None:
            event["checkpoint_path"] = checkpoint.path
        self.queue.put_nowait(event)


class ReportPump:
    """A driver thread that drains the relay queue into handlers until stopped."""

    def __init__(self, queue: Any, handlers: list[Callable[[dict[str, Any]], None]]):
        self.queue = queue
        self.handlers = handlers
        self.last: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-reports", daemon=True)
        self.errors: list[BaseException] = []

    def __enter__(self) -> ReportPump:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._drain(block=False)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=True)

    def _drain(self, block: bool) -> None:
        from ray.util.queue import Empty

        while True:
            try:
                event = (
                    self.queue.get(block=block, timeout=0.5) if block else (self.queue.get_nowait())
                )
            except Empty:
                return
            except Exception as exc:  # the queue actor went away with Ray
                self.errors.append(exc)
                return
            self.last = event
            for handler in self.handlers:
                try:
                    handler(event)
                except Exception as exc:  # a tracker outage must not stop training
                    self.errors.append(exc)
            block = False


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class ProgressLine:
    """Formats reports as one line: epoch, step, loss, val metrics, samples/s, ETA.

    On a terminal the line is redrawn in place; elsewhere (CI logs, files) a line is printed
    at each epoch end and at most every ``interval_s`` seconds between.
    """

    def __init__(
        self,
        max_epochs: int | None,
        max_steps: int,
        stream: TextIO | None = None,
        interval_s: float = 15.0,
    ):
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval_s = interval_s
        self._start = time.monotonic()
        self._first_step: tuple[float, int] | None = None
        self._steps_per_epoch: float | None = None
        self._printed_at = 0.0
        self._width = 0

    def total_steps(self) -> float | None:
        if self.max_steps and self.max_steps > 0:
            return self.max_steps
        if self.max_epochs and self._steps_per_epoch:
            return self.max_epochs * self._steps_per_epoch
        return None

    def format(self, event: dict[str, Any]) -> str:
        step, epoch = int(event.get("step", 0)), int(event.get("epoch", 0))
        now = time.monotonic()
        if event.get("kind") in ("epoch", "end") and step:
            self._steps_per_epoch = step / (epoch + 1)
        if self._first_step is None:
            self._first_step = (now, step)
        parts = [f"epoch {epoch + 1}/{self.max_epochs or '?'}", f"step {step}"]
        for key in ("train_loss", "val_loss", "val_acc"):
            if isinstance(event.get(key), float) and math.isfinite(event[key]):
                parts.append(f"{key} {event[key]:.4f}")
        if "samples_per_s" in event:
            parts.append(f"{event['samples_per_s']:.0f} samples/s")
        t0, s0 = self._first_step
        total = self.total_steps()
        if total and step > s0 and now > t0:
            rate = (step - s0) / (now - t0)
            parts.append(f"ETA {_fmt_duration((total - step) / rate)}")
        parts.append(f"elapsed {_fmt_duration(now - self._start)}")
        return " | ".join(parts)

    def __call__(self, event: dict[str, Any]) -> None:
        line = self.format(event)
        now = time.monotonic()
        if self.tty:
            pad = max(self._width - len(line), 0)
            self.stream.write("\r" + line + " " * pad)
            self._width = len(line)
        elif event.get("kind") in ("epoch", "end") or now - self._printed_at >= self.interval_s:
            self.stream.write(line + "\n")
            self._printed_at = now
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
