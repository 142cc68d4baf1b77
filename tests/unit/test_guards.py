"""The train-loop guards' decisions without Ray or a Trainer: ``FiniteGuard`` stops at the
first non-finite gradient, ``PreemptionGuard`` checkpoints once per notice and, after a
SIGTERM, stops every rank with ``PreemptedError``.

The trainer and the checkpointing callback are plain fakes with only what the guards read;
the model is a real torch module; the SIGTERM is a real signal to this process.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from raytrain.errors import NonFiniteLossError, PreemptedError
from raytrain.worker import preemption
from raytrain.worker.guards import FiniteGuard, PreemptionGuard


@dataclass
class FakeStrategy:
    root_device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass
class FakeProgress:
    is_last_batch: bool = False


@dataclass
class FakeEpochLoop:
    batch_progress: FakeProgress = field(default_factory=FakeProgress)


@dataclass
class FakeFitLoop:
    epoch_loop: FakeEpochLoop = field(default_factory=FakeEpochLoop)


@dataclass
class FakeTrainer:
    """What the guards read of a Lightning Trainer."""

    global_step: int = 0
    current_epoch: int = 0
    strategy: FakeStrategy = field(default_factory=FakeStrategy)
    fit_loop: FakeFitLoop = field(default_factory=FakeFitLoop)
    max_epochs: int = 10
    max_steps: int = -1
    should_stop: bool = False


class FakeReport:
    """The checkpointing callback: records each ``checkpoint_now``."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []
        self.keeps_no_position = False

    def checkpoint_now(self, trainer: FakeTrainer, kind: str) -> None:
        self.calls.append((trainer.global_step, kind))

    def defer_to_epoch_end(self, trainer: FakeTrainer) -> bool:
        return self.keeps_no_position


def _model(grad: float) -> torch.nn.Module:
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    model.bias.grad[1] = grad  # type: ignore[index]
    return model


def test_finite_gradients_pass() -> None:
    FiniteGuard().on_before_optimizer_step(FakeTrainer(), _model(1.0), None)  # type: ignore[arg-type]


def test_no_gradients_pass() -> None:
    FiniteGuard().on_before_optimizer_step(FakeTrainer(), torch.nn.Linear(2, 2), None)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_gradient_stops_the_step_it_is_in(bad: float) -> None:
    trainer = FakeTrainer(global_step=6, current_epoch=2)
    with pytest.raises(NonFiniteLossError) as caught:
        FiniteGuard().on_before_optimizer_step(trainer, _model(bad), None)  # type: ignore[arg-type]
    message = str(caught.value)
    # the step about to be applied (global_step + 1), one-based epoch, and no retry
    assert "optimizer step 7 (epoch 3)" in message
    assert "not retried" in message


@pytest.fixture
def sigterm_notice() -> Iterator[None]:
    """raytrain's SIGTERM handler installed in this process, as in a training worker; the
    previous handler and a clear notice state come back afterwards."""
    previous = signal.getsignal(signal.SIGTERM)
    preemption.install_sigterm_notice()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        preemption.training(False)
        preemption._sigterm.clear()  # the notice is once per process; tests run several


def _steps(guard: PreemptionGuard, trainer: FakeTrainer, *steps: int) -> None:
    for step in steps:
        trainer.global_step = step
        guard.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]


def test_without_a_notice_nothing_is_checkpointed(sigterm_notice: None) -> None:
    report, trainer = FakeReport(), FakeTrainer()
    guard = PreemptionGuard(report, check_s=0.0)  # check at every step
    guard.on_train_start(trainer, None)  # type: ignore[arg-type]
    _steps(guard, trainer, 1, 2, 3)
    assert report.calls == []


def test_a_sigterm_while_training_checkpoints_then_stops_every_rank(sigterm_notice: None) -> None:
    report, trainer = FakeReport(), FakeTrainer(global_step=4)
    guard = PreemptionGuard(report, check_s=0.0)
    guard.on_train_start(trainer, None)  # type: ignore[arg-type]
    _steps(guard, trainer, 5)
    signal.raise_signal(signal.SIGTERM)  # the notice: recorded, training goes on
    assert preemption.notice() == "SIGTERM"
    with pytest.raises(PreemptedError, match="checkpoint at step 6 committed"):
        _steps(guard, trainer, 6)
    assert report.calls == [(6, "preemption (SIGTERM)")]
    _steps(guard, trainer, 7)  # the same notice is acted on once
    assert len(report.calls) == 1


def test_the_drivers_request_checkpoints_then_stops_every_rank(sigterm_notice: None) -> None:
    # rank 0 reads the driver's request (SIGUSR1 to `raytrain run`) from the run's sink
    asked = [False]
    preemption.watch_requests(lambda: asked[0])
    try:
        report, trainer = FakeReport(), FakeTrainer(global_step=0)
        guard = PreemptionGuard(report, check_s=0.0)
        guard.on_train_start(trainer, None)  # type: ignore[arg-type]
        _steps(guard, trainer, 1, 2)
        asked[0] = True
        with pytest.raises(PreemptedError, match=r"SIGUSR1.*checkpoint at step 3 committed"):
            _steps(guard, trainer, 3)
        assert report.calls == [(3, "preemption (requested)")]
    finally:
        preemption.watch_requests(None)
    assert preemption.notice() is None


def test_a_notice_at_an_epochs_last_batch_is_acted_on_at_the_epochs_end(
    sigterm_notice: None,
) -> None:
    # a checkpoint in the last batch's on_train_batch_end resumed at the next epoch with
    # this one's validation skipped and its steps lost (a Slurm job: 345 steps of 368)
    report, trainer = FakeReport(), FakeTrainer(global_step=22)
    guard = PreemptionGuard(report, check_s=0.0)
    guard.on_train_start(trainer, None)  # type: ignore[arg-type]
    signal.raise_signal(signal.SIGTERM)
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True
    _steps(guard, trainer, 23)
    assert report.calls == []  # the epoch's validation and end run first
    with pytest.raises(PreemptedError, match="checkpoint at step 23 committed"):
        guard.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
    assert report.calls == [(23, "preemption (SIGTERM)")]
    guard.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
    assert len(report.calls) == 1


def test_a_stop_at_the_last_epochs_end_lets_the_run_finish(sigterm_notice: None) -> None:
    # stopping a run that ends here anyway would requeue a finished run (exit 4)
    report, trainer = FakeReport(), FakeTrainer(global_step=44, current_epoch=1, max_epochs=2)
    guard = PreemptionGuard(report, check_s=0.0)
    guard.on_train_start(trainer, None)  # type: ignore[arg-type]
    signal.raise_signal(signal.SIGTERM)
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True
    _steps(guard, trainer, 46)
    guard.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]  # no PreemptedError
    assert report.calls == [(46, "preemption (SIGTERM)")]


def test_a_loader_without_a_position_is_stopped_at_the_epochs_end(sigterm_notice: None) -> None:
    # its checkpoints are taken at epochs' ends: stopping mid-epoch would save nothing
    report, trainer = FakeReport(), FakeTrainer(global_step=4)
    report.keeps_no_position = True
    guard = PreemptionGuard(report, check_s=0.0)
    guard.on_train_start(trainer, None)  # type: ignore[arg-type]
    signal.raise_signal(signal.SIGTERM)
    _steps(guard, trainer, 5, 6)  # training goes on to the epoch's end
    assert report.calls == []
    with pytest.raises(PreemptedError, match="checkpoint at step 6 committed"):
        guard.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]


def test_the_notice_is_checked_only_at_a_new_step_when_due(sigterm_notice: None) -> None:
    report, trainer = FakeReport(), FakeTrainer()
    # a check interval far longer than any step: after the first check, the next is 1000
    # steps on (the most it is ever put off)
    guard = PreemptionGuard(report, check_s=1e9)
    guard.on_train_start(trainer, None)  # type: ignore[arg-type]
    _steps(guard, trainer, 1)
    signal.raise_signal(signal.SIGTERM)
    _steps(guard, trainer, 1, 2, 500, 1000)  # accumulating at step 1, then not due
    assert report.calls == []
    with pytest.raises(PreemptedError):
        _steps(guard, trainer, 1001)
    assert report.calls == [(1001, "preemption (SIGTERM)")]


def test_a_sigterm_outside_training_exits_as_rays_handler_does(sigterm_notice: None) -> None:
    trainer = FakeTrainer()
    guard = PreemptionGuard(FakeReport())
    guard.on_train_start(trainer, None)  # type: ignore[arg-type]
    guard.on_train_end(trainer, None)  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        signal.raise_signal(signal.SIGTERM)
    assert preemption.notice() is None


def test_an_exception_ends_training_for_the_notice(sigterm_notice: None) -> None:
    trainer = FakeTrainer()
    guard = PreemptionGuard(FakeReport())
    guard.on_train_start(trainer, None)  # type: ignore[arg-type]
    guard.on_exception(trainer, None, RuntimeError("boom"))  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        signal.raise_signal(signal.SIGTERM)
