"""System metrics of a training worker, sampled with each metrics report (rank 0's).

``SystemMetrics`` is a listener of the step clock (``worker.step_clock``) that times the
training loop itself: the time per
optimizer step, and the part of it spent outside the step, waiting for the next batch
(between one batch's end and the next one's start, where Lightning pulls from the loader).
``sample()`` turns the window since the last sample into ``system/...`` metrics, with the
process's CPU use and memory and, on a GPU, its utilization and memory. Standard library and
torch only: nothing to install, nothing that fails on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

from raytrain.worker.step_clock import StepListener, Tick

if TYPE_CHECKING:
    import torch

PREFIX = "system/"


def _rss_bytes() -> float | None:
    """This process's resident memory (Linux: /proc; elsewhere its peak, from rusage)."""
    try:
        with open("/proc/self/statm") as f:
            return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import resource

            return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        except (ImportError, OSError):
            return None


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _gpu(device: torch.device | None) -> dict[str, float]:
    """Utilization (needs NVML, which torch uses when present) and memory of ``device``."""
    import torch

    if device is None or getattr(device, "type", None) != "cuda":
        return {}
    values = {
        f"{PREFIX}gpu_memory_allocated_mb": torch.cuda.memory_allocated(device) / 2**20,
        f"{PREFIX}gpu_memory_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20,
    }
    # without NVML on the machine utilization is unknown, not zero
    with contextlib.suppress(Exception):
        values[f"{PREFIX}gpu_utilization_percent"] = float(torch.cuda.utilization(device))
    return values


class SystemMetrics(StepListener):
    """Times steps and data waits from the step clock's marks; ``sample()`` reports and
    restarts the window. The wait for data is what lies between a batch's end marker and
    the next batch's start. ``clock`` must be the step clock's (``sample`` reads it)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.perf_counter,
        cpu_seconds: Callable[[], float] = _cpu_seconds,
    ) -> None:
        # the clocks are parameters so that a test can drive the windows step by step
        self._clock = clock
        self._cpu_seconds = cpu_seconds
        self._device: Any = None
        self._reset(clock())
        self._batch_start_at = self._window_start
        self._batch_end_at: float | None = None

    def _reset(self, now: float, step: int = 0) -> None:
        self._window_start = now
        self._window_step = step
        self._cpu_start = self._cpu_seconds()
        self._data_wait = 0.0
        self._loop_time = 0.0  # wall time inside training batches and the waits between

    def train_started(self, tick: Tick, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._device = pl_module.device
        self._reset(tick.now, trainer.global_step)

    def batch_started(self, tick: Tick, trainer: pl.Trainer) -> None:
        now = tick.now
        if self._batch_end_at is not None:
            self._data_wait += now - self._batch_end_at
            self._loop_time += now - self._batch_end_at
        self._batch_start_at = now

    def batch_done(self, tick: Tick, trainer: pl.Trainer) -> None:
        """The batch and every callback after it are done: what follows until the next
        batch starts is Lightning fetching it."""
        self._loop_time += tick.now - self._batch_start_at
        self._batch_end_at = tick.now

    # validation and epoch ends are not waits for data
    def validation_started(self, tick: Tick) -> None:
        self._batch_end_at = None

    def epoch_ended(self, tick: Tick) -> None:
        self._batch_end_at = None

    def sample(self, step: int) -> dict[str, float]:
        """Metrics for the window since the last sample, which ends at global step ``step``;
        the timing ones only when optimizer steps ran in it."""
        now = self._clock()
        wall = now - self._window_start
        steps = step - self._window_step
        values: dict[str, float] = {}
        if steps > 0 and wall > 0:
            values[f"{PREFIX}step_time_s"] = wall / steps
            if self._loop_time > 0:
                values[f"{PREFIX}data_wait_fraction"] = min(self._data_wait / self._loop_time, 1.0)
            values[f"{PREFIX}cpu_percent"] = 100.0 * (self._cpu_seconds() - self._cpu_start) / wall
        rss = _rss_bytes()
        if rss is not None:
            values[f"{PREFIX}memory_rss_mb"] = rss / 2**20
        values.update(_gpu(self._device))
        self._reset(now, step)
        return values
