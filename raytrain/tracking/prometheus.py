"""Training metrics through Ray's metrics API, for the Prometheus that scrapes a cluster.

``RayMetrics`` handles the run's events on the driver, beside MLflow and the status record:
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
from typing import Any

from raytrain.checkpoints.layout import TIMELINE_KEY, number
from raytrain.contract import HANG_KEY

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


def ray_gauge(name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
    """A ``ray.util.metrics.Gauge``: what ``RayMetrics`` makes its gauges with."""
    from ray.util.metrics import Gauge

    return Gauge(name, description=description, tag_keys=tag_keys)


class RayMetrics:
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

    def report(self, event: dict[str, Any]) -> None:
        """One of rank 0's reports."""
        if "step" not in event:  # a notice (a failure), not a report
            return
        if "_worker_started_at" in event:  # a new worker group's first report
            self._groups += 1
            self._set("raytrain_restarts", self._groups - 1)
        for key, value in event.items():
            reported = number(value)
            if reported is None or key.startswith("_") or key in ("world_size", "kind"):
                continue
            if key in _OWN:
                self._set(_OWN[key], reported)
            elif not key.startswith("system/"):
                self._set("raytrain_metric", reported, name=key)

    def timeline(self, event: dict[str, Any]) -> None:
        """A rank's step-timeline window."""
        rank = int(event.get("rank", 0))
        for part, values in event[TIMELINE_KEY].items():
            for stat, value in zip(_STATS, values, strict=False):
                self._set("raytrain_step_part_seconds", float(value), rank, part=part, stat=stat)

    def hang(self, event: dict[str, Any]) -> None:
        """A rank's hang report."""
        rank = int(event[HANG_KEY]["rank"])
        self._hangs[rank] = self._hangs.get(rank, 0) + 1
        self._set("raytrain_hangs", self._hangs[rank], rank)
