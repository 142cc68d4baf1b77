"""The windows of ``system_metrics.SystemMetrics`` without Ray or a Trainer: each sample
covers the time since the previous one, the wait for data is what lies between one batch's
last hook and the next batch's start, and validation is no such wait.

The clocks are plain fakes a test moves by hand, so every figure is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from raytrain.worker.step_clock import StepClock
from raytrain.worker.system_metrics import PREFIX, SystemMetrics

STEP_TIME, DATA_WAIT, CPU = (
    f"{PREFIX}{k}" for k in ("step_time_s", "data_wait_fraction", "cpu_percent")
)


class Clock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeTrainer:
    global_step: int = 0
    world_size: int = 1


class FakeModule:
    device = torch.device("cpu")


class Loop:
    """Drives the step clock, and the metrics through it, as Lightning's fit loop calls it,
    with the fake clocks."""

    def __init__(self) -> None:
        self.clock, self.cpu = Clock(), Clock()
        self.metrics = SystemMetrics(clock=self.clock, cpu_seconds=self.cpu)
        self.step_clock = StepClock([self.metrics], clock=self.clock)
        self.marker = self.step_clock.end_marker()
        self.trainer = FakeTrainer()
        self.step_clock.on_train_start(self.trainer, FakeModule())  # type: ignore[arg-type]

    def batch(self, wait: float, compute: float, cpu: float = 0.0, hooks: float = 0.0) -> None:
        """A batch that Lightning waited ``wait`` s for, then trained on for ``compute`` s,
        then spent ``hooks`` s in the callbacks' batch-end hooks before the end marker."""
        self.clock.advance(wait)
        self.step_clock.on_train_batch_start(self.trainer, None, None, 0)  # type: ignore[arg-type]
        self.clock.advance(compute)
        self.cpu.advance(cpu)
        self.trainer.global_step += 1
        self.clock.advance(hooks)
        self.marker.on_train_batch_end(self.trainer, None, None, None, 0)  # type: ignore[arg-type]

    def sample(self) -> dict[str, float]:
        return self.metrics.sample(self.trainer.global_step)


def test_a_window_reports_step_time_data_wait_and_cpu() -> None:
    loop = Loop()
    loop.batch(wait=0.0, compute=1.0, cpu=0.5)  # the first batch: no wait measured before it
    loop.batch(wait=1.0, compute=1.0, cpu=1.5)
    values = loop.sample()
    assert values[STEP_TIME] == pytest.approx(1.5)  # 3 s over 2 steps
    assert values[DATA_WAIT] == pytest.approx(1 / 3)  # 1 s waiting of 3 s in the loop
    assert values[CPU] == pytest.approx(100 * 2.0 / 3.0)
    assert values[f"{PREFIX}memory_rss_mb"] > 0  # this process's real memory


def test_each_sample_covers_only_the_time_since_the_last() -> None:
    loop = Loop()
    loop.batch(wait=0.0, compute=4.0)
    assert loop.sample()[STEP_TIME] == pytest.approx(4.0)
    loop.batch(wait=0.0, compute=1.0)
    loop.batch(wait=0.0, compute=1.0)
    second = loop.sample()
    assert second[STEP_TIME] == pytest.approx(1.0)
    assert second[DATA_WAIT] == pytest.approx(0.0)


def test_a_window_without_steps_has_no_timing() -> None:
    loop = Loop()
    loop.batch(wait=0.0, compute=1.0)
    loop.sample()
    loop.clock.advance(5.0)  # e.g. a validation between two reports
    values = loop.sample()
    assert STEP_TIME not in values and DATA_WAIT not in values and CPU not in values
    assert f"{PREFIX}memory_rss_mb" in values


@pytest.mark.parametrize("pause", ["on_validation_start", "on_train_epoch_end"])
def test_validation_and_epoch_ends_are_not_waits_for_data(pause: str) -> None:
    loop = Loop()
    loop.batch(wait=0.0, compute=1.0)
    getattr(loop.step_clock, pause)(loop.trainer, None)
    loop.batch(wait=10.0, compute=1.0)  # the 10 s were validation, not the loader
    loop.batch(wait=2.0, compute=1.0)
    values = loop.sample()
    assert values[DATA_WAIT] == pytest.approx(2.0 / 5.0)  # 2 s of 1+1+2+1 in the loop


def test_hooks_after_the_batch_are_not_waits_for_data() -> None:
    loop = Loop()
    loop.batch(wait=0.0, compute=1.0, hooks=3.0)  # e.g. a checkpoint saved at that step
    loop.batch(wait=1.0, compute=1.0)
    values = loop.sample()
    assert values[DATA_WAIT] == pytest.approx(1.0 / 6.0)  # 1 s of 4+1+1 in the loop
    assert values[STEP_TIME] == pytest.approx(3.0)


def test_a_cpu_run_reports_no_gpu_figures() -> None:
    values = Loop().sample()
    assert not [k for k in values if k.startswith(f"{PREFIX}gpu_")]
