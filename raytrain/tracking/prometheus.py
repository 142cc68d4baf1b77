"""Training metrics through Ray's metrics API, for the Prometheus that scrapes a cluster.

``RayMetrics`` hears the run's events on the driver, beside MLflow and the status record:
rank 0's reports (step, epoch, samples/s, train loss, every other metric, checkpoint
stall, restarts), every rank's step timeline (each part's p50, p90 and mean) and hang
reports. It sets them as ``ray.util.metrics`` gauges. Ray serves them from the metrics
endpoint of the driver's node (``ray start --metrics-export-port``), beside Ray's own,
with a ``ray_`` prefix: ``ray_raytrain_step{run="digits-cnn",rank="0"}``. Every series
carries ``run`` (the spec's name) and ``rank``. The step-time parts also carry ``part``
and ``stat``, and the other metrics ``name``. ``GAUGES`` lists them all, and
``cluster/grafana/raytrain.json`` charts them.

raytrain's embedded cluster collects no metrics (``driver.ray_runtime``): there the
gauges are set for nothing, a few microseconds a report. ``tracking.prometheus: false``
turns them off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raytrain.contract import HangReport, Report, RunListener, TimelineWindow

if TYPE_CHECKING:
    from ray.util.metrics import Gauge

# name -> (description, tag keys besides run and rank)
GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "raytrain_step": ("The optimizer step rank 0 reported last.", ()),
    "raytrain_epoch": ("The epoch of rank 0's last report (0-based).", ()),
    "raytrain_samples_per_second": ("Samples a second over the last report window, all ranks.", ()),
    "raytrain_train_loss": ("The train loss of rank 0's last report.", ()),
    "raytrain_metric": ("Every other number rank 0 reports (validation metrics...).", ("name",)),
    "raytrain_checkpoint_stall_seconds": ("How long the last checkpoint held training up.", ()),
    "raytrain_restarts": ("Worker-group restarts within the run so far.", ()),
    "raytrain_step_part_seconds": (
        "A rank's step time by part (data_wait, forward, backward, comm_wait, optimizer, "
        "hooks, busy, step) over the last report window: p50, p90 or mean.",
        ("part", "stat"),
    ),
    "raytrain_hangs": ("Hangs this rank reported (failure.hang_timeout_s).", ()),
}
_STATS = ("p50", "p90", "mean")
# rank 0's report keys set as gauges of their own (the rest go to raytrain_metric)
_OWN = {
    "step": "raytrain_step",
    "epoch": "raytrain_epoch",
    "samples_per_s": "raytrain_samples_per_second",
    "train_loss": "raytrain_train_loss",
    "checkpoint_blocked_s": "raytrain_checkpoint_stall_seconds",
}


def ray_gauge(name: str, description: str, tag_keys: tuple[str, ...]) -> Gauge:
    """A ``ray.util.metrics.Gauge``: what ``RayMetrics`` makes its gauges with."""
    from ray.util.metrics import Gauge

    return Gauge(name, description=description, tag_keys=tag_keys)


class RayMetrics(RunListener):
    """The run's gauges (see the module docstring). ``make`` builds a gauge from a name, a
    description and tag keys (a unit test passes a recorder)."""

    def __init__(self, run: str, make: Callable[[str, str, tuple[str, ...]], Any] = ray_gauge):
        self.run = run
        self._gauges = {
            name: make(name, text, ("run", "rank", *keys)) for name, (text, keys) in GAUGES.items()
        }
        self._groups = 0  # worker groups that reported: restarts + 1
        self._hangs: dict[int, int] = {}

    def _set(self, gauge: str, value: float, rank: int = 0, **tags: str) -> None:
        self._gauges[gauge].set(value, tags={"run": self.run, "rank": str(rank), **tags})

    def on_report(self, report: Report) -> None:
        """One of rank 0's reports."""
        if report.startup is not None:  # a new worker group's first report
            self._groups += 1
            self._set("raytrain_restarts", self._groups - 1)
        numbers = {**report.metrics, "step": report.step, "epoch": report.epoch}
        for key, value in numbers.items():
            if key in _OWN:
                self._set(_OWN[key], float(value))
            elif not key.startswith("system/"):
                self._set("raytrain_metric", float(value), name=key)

    def on_timeline(self, window: TimelineWindow) -> None:
        """A rank's step-timeline window."""
        for part, values in window.parts.items():
            for stat, value in zip(_STATS, values, strict=False):
                self._set(
                    "raytrain_step_part_seconds", float(value), window.rank, part=part, stat=stat
                )

    def on_hang(self, report: HangReport) -> None:
        """A rank's hang report."""
        rank = report.rank
        self._hangs[rank] = self._hangs.get(rank, 0) + 1
        self._set("raytrain_hangs", self._hangs[rank], rank)
