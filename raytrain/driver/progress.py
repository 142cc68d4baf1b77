"""The driver's view of training: the run's events, and one live progress line.

The ranks send their events (``contract.events``) to a ``MetricsSink`` actor; ``ReportPump``
on the driver drains it and hands each event to every ``RunListener`` by its type: the
progress line, MLflow, the status record, the timelines, ... ``ProgressLine`` is one line
in place of N interleaved per-rank Lightning bars; ``Latest`` keeps what the run ends with.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from raytrain.contract import Event, FailureNotice, Report, RunListener, Startup, deliver

if TYPE_CHECKING:
    from ray.actor import ActorHandle


class MetricsSink:
    """A Ray actor (0 CPUs) holding the run's events until the driver drains them: rank 0's
    metric reports, every rank's step timelines, the failure policy's notices.

    Metrics travel outside ``ray.train.report``: a report waits for the train controller's
    next poll (every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``), so reporting every few steps
    would stall training. Rank 0 sends events fire-and-forget; Ray keeps one caller's actor
    calls in order.
    """

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._started = time.time()
        self._failures = 0
        self._preempt = False

    def request_preemption(self) -> None:
        """The driver was asked to stop at a committed checkpoint (``driver.preempt_request``)."""
        self._preempt = True

    def preemption_requested(self) -> bool:
        """Whether the driver asked: rank 0's ``PreemptionGuard`` and the failure policy
        read it (a ``"requested"`` notice; a preemption then stops the run)."""
        return self._preempt

    def put(self, event: Event) -> None:
        self._events.append(event)
        if isinstance(event, FailureNotice):  # the failure policy's, of a worker-group failure
            self._failures += 1

    def mtbf(self) -> float | None:
        """The run's mean time between failures so far, in seconds (this driver's time
        over the worker-group failures it saw); None before the first failure. What
        ``checkpoint.every_n_steps: auto`` chooses its interval by."""
        return (time.time() - self._started) / self._failures if self._failures else None

    def ping(self) -> bool:
        """Returns once every event this caller sent before has been stored."""
        return True

    def drain(self) -> list[Event]:
        events, self._events = self._events, []
        return events


def start_sink() -> Any:
    """Start a ``MetricsSink`` actor on this node; returns its handle.

    Pinned here (not a preference: Ray placed a soft-pinned one on another node of a
    multi-node cluster), so losing a training node never loses the run's metrics."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    actor = ray.remote(num_cpus=0, max_restarts=-1)(MetricsSink)
    return actor.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)
    ).remote()


class SinkNotice:
    """Sends a ``FailureNotice`` to the sink: what the failure policy, in Ray Train's
    controller, tells the driver (why the workers restart). Picklable: it travels with the
    policy to the controller."""

    def __init__(self, sink: ActorHandle):
        self.sink = sink

    def __call__(self, text: str) -> None:
        self.sink.put.remote(FailureNotice(text))


class SinkRequested:
    """Whether the driver asked the run to stop at a checkpoint (the sink's flag), or False
    when the sink cannot be asked in ``timeout_s``. Picklable: rank 0 and the failure
    policy each get one."""

    def __init__(self, sink: ActorHandle, timeout_s: float = 10.0):
        self.sink = sink
        self.timeout_s = timeout_s

    def __call__(self) -> bool:
        import ray

        try:
            return bool(ray.get(self.sink.preemption_requested.remote(), timeout=self.timeout_s))
        except Exception:  # a sink restarting or slow: no request seen this time
            return False


def stop_sink(sink: ActorHandle) -> None:
    """End the sink's actor once its events are drained: its handle also sits in the
    trainer's worker config, so it would otherwise outlive the run."""
    import ray

    ray.kill(sink)


class StopRun(Exception):
    """Raised by a ``ReportPump`` handler to end the run with ``error`` (a sweep's metric
    that the trial does not report): the pump stops training, and ``fit`` raises it."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class ReportPump:
    """A driver thread that drains the sink until stopped, handing every event to each of
    ``listeners`` in turn (``contract.deliver``: the listener's method for its type). A
    listener's error is kept (``errors``) and training goes on, unless it is a ``StopRun``:
    then ``on_stop`` is called once (it aborts the trainer) and ``stopped`` holds it."""

    def __init__(
        self,
        sink: Any,
        listeners: Sequence[RunListener],
        interval_s: float = 1.0,
        on_stop: Callable[[], None] | None = None,
    ):
        self.sink = sink
        self.listeners = list(listeners)
        self.interval_s = interval_s
        self.on_stop = on_stop
        self.stopped: StopRun | None = None
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-reports", daemon=True)

    def __enter__(self) -> ReportPump:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._drain()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._drain()

    def _drain(self) -> None:
        import ray

        try:
            events = ray.get(self.sink.drain.remote(), timeout=30)
        except Exception as exc:  # the sink went away with Ray; training decides the outcome
            self.errors.append(exc)
            return
        for event in events:
            for listener in self.listeners:
                try:
                    deliver(event, listener)
                except StopRun as stop:
                    if self.stopped is None:
                        self.stopped = stop
                        if self.on_stop is not None:
                            self.on_stop()
                except Exception as exc:  # a tracker outage must not stop training
                    self.errors.append(exc)


class Latest(RunListener):
    """What the run ends with, from rank 0's reports: the newest value of every number
    (``values``), the newest worker group's ``startup``, and why a callback stopped it."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.startup: Startup | None = None
        self.stopped: str | None = None

    def on_report(self, report: Report) -> None:
        self.values.update(report.values())
        if report.startup is not None:
            self.startup = report.startup
        if report.stopped is not None:
            self.stopped = report.stopped


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class ProgressLine(RunListener):
    """Formats reports as one line: epoch, step, loss, val metrics, samples/s, ETA, and the
    straggler the ranks' timelines name (``straggler``, set by the driver).

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
        self.straggler: str | None = None  # the rank the timelines name (driver.timeline)

    def total_steps(self) -> float | None:
        if self.max_steps and self.max_steps > 0:
            return self.max_steps
        if self.max_epochs and self._steps_per_epoch:
            return self.max_epochs * self._steps_per_epoch
        return None

    def format(self, report: Report) -> str:
        step, epoch, metrics = report.step, report.epoch, report.metrics
        now = time.monotonic()
        if report.kind in ("epoch", "end") and step:
            self._steps_per_epoch = step / (epoch + 1)
        if self._first_step is None:
            self._first_step = (now, step)
        parts = [f"epoch {epoch + 1}/{self.max_epochs or '?'}", f"step {step}"]
        for key in ("train_loss", "val_loss", "val_acc"):
            value = metrics.get(key)
            if isinstance(value, float) and math.isfinite(value):
                parts.append(f"{key} {value:.4f}")
        if "samples_per_s" in metrics:
            parts.append(f"{metrics['samples_per_s']:.0f} samples/s")
        t0, s0 = self._first_step
        total = self.total_steps()
        if total and step > s0 and now > t0:
            rate = (step - s0) / (now - t0)
            parts.append(f"ETA {_fmt_duration((total - step) / rate)}")
        parts.append(f"elapsed {_fmt_duration(now - self._start)}")
        if self.straggler:
            parts.append(f"straggler {self.straggler}")
        return " | ".join(parts)

    def on_report(self, report: Report) -> None:
        line = self.format(report)
        now = time.monotonic()
        if self.tty:
            pad = max(self._width - len(line), 0)
            self.stream.write("\r" + line + " " * pad)
            self._width = len(line)
        elif report.kind in ("epoch", "end") or now - self._printed_at >= self.interval_s:
            self.stream.write(line + "\n")
            self._printed_at = now
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
