"""The sweep driver's hooks into Ray Tune's loop: the metric gate and the trial lines."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray.tune import Callback, Stopper

from raytrain.sweep.space import values_of
from raytrain.sweep.trial import TRIAL_NAME, trial_name
from raytrain.util.redaction import redact_value

if TYPE_CHECKING:
    from ray.tune.experiment import Trial

METRIC_PREFIX = "tune.metric: "
# The sweep folders whose lease another sweep took over, in this driver: their gate stops
# Tune. A set, not the lease: Tune keeps its stopper with its experiment, and a restored
# sweep's gate is that copy.
LOST_LEASES: set[str] = set()


def metric_error(error: object) -> str | None:
    """The ``tune.metric: ...`` line of a trial's error (its metric is not reported)."""
    text = str(error or "")
    if METRIC_PREFIX not in text:
        return None
    return METRIC_PREFIX + text.split(METRIC_PREFIX, 1)[1].splitlines()[0]


class MetricGate(Callback, Stopper):
    """Stops the whole sweep once a trial ended because the sweep's metric is not among
    what it reports (every trial would report alike), or once another sweep took the
    folder's lease over (``LOST_LEASES``)."""

    def __init__(self, folder: str = "") -> None:
        self.error: str | None = None
        self.folder = folder

    def on_trial_error(
        self, iteration: int, trials: list[Trial], trial: Trial, **info: Any
    ) -> None:
        if self.error is None:
            self.error = metric_error(trial.get_pickled_error() or trial.get_error())

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return False

    def stop_all(self) -> bool:
        return self.error is not None or self.folder in LOST_LEASES


class TrialLines(Callback):
    """One line on stderr as each trial ends: how, after how many epochs, its metric, its
    values; ``shown``: the listed values as they may be shown (redacted), by field."""

    def __init__(self, sweep: str, metric: str, shown: dict[str, list[Any]] | None = None):
        self.sweep, self.metric, self.shown = sweep, metric, shown or {}

    def on_trial_complete(
        self, iteration: int, trials: list[Trial], trial: Trial, **info: Any
    ) -> None:
        self._say(trial, "finished" if (trial.last_result or {}).get(TRIAL_NAME) else "stopped")

    def on_trial_error(
        self, iteration: int, trials: list[Trial], trial: Trial, **info: Any
    ) -> None:
        self._say(trial, "failed")

    def _say(self, trial: Trial, how: str) -> None:
        import sys

        result = trial.last_result or {}
        value = result.get(self.metric)
        shown = f"{self.metric} {value:.4g}" if isinstance(value, float) else "no metric"
        config = {k: redact_value(k, v) for k, v in values_of(trial.config, self.shown).items()}
        values = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in config.items()
        )
        name = trial_name(self.sweep, trial.trial_id)
        epochs = result.get("epoch", 0)
        print(
            f"raytrain: trial {name} {how} after {epochs} epoch(s): {shown} ({values})",
            file=sys.stderr,
        )
