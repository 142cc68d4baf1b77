"""The hang watchdog driven hook by hook with its own clock (no Trainer, no thread, no
process ended), the allowances it judges by, and the driver's handling of the reports."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from raytrain.contract import Event, HangReport, Report
from raytrain.driver.hangs import Hangs, hang_summary
from raytrain.driver.progress import ProgressLine
from raytrain.spec.sections import HangLimits
from raytrain.worker.hang_watchdog import (
    HANG_EXIT,
    HangWatchdog,
    allowance,
    collective_of,
    step_timeout,
)
from raytrain.worker.step_clock import StepClock

LIMITS = HangLimits(timeout_s=None, first_step_s=300.0, checkpoint_s=120.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_automatic_timeout_is_20_median_steps_and_never_under_a_minute() -> None:
    assert step_timeout(LIMITS, []) == 300.0  # no step timed yet: the first step's
    assert step_timeout(LIMITS, [0.05] * 10) == 60.0
    assert step_timeout(LIMITS, [4.0, 5.0, 100.0]) == 100.0  # the median: one slow step
    fixed = HangLimits(timeout_s=10.0, first_step_s=300.0, checkpoint_s=120.0)
    assert step_timeout(fixed, [50.0]) == 10.0
    assert not HangLimits(0, 1, 1).enabled and fixed.enabled


@pytest.mark.parametrize("steps", [[], [0.05], [30.0] * 5])
@pytest.mark.parametrize("limits", [LIMITS, HangLimits(10.0, 300.0, 120.0)])
def test_a_first_batch_and_a_save_get_their_own_allowance_never_below_a_step(
    steps: list[float], limits: HangLimits
) -> None:
    base = step_timeout(limits, steps)
    for phase in ("data", "forward", "backward", "optimizer", "validation"):
        assert allowance(phase, limits, steps) == base
    assert allowance("starting", limits, steps) == max(base, limits.first_step_s)
    assert allowance("saving", limits, steps) == max(base, limits.checkpoint_s)


def test_a_collective_is_a_torch_distributed_call_or_ddps_backward() -> None:
    c10d = ["/x/loop.py", "/site-packages/torch/distributed/distributed_c10d.py"]
    assert collective_of("saving", c10d, 2) == "a torch.distributed collective"
    assert collective_of("backward", ["/x/loop.py"], 2) == "the gradients' all-reduce (backward)"
    assert collective_of("backward", ["/x/loop.py"], 1) is None  # no one to wait for
    assert collective_of("forward", ["/x/models.py"], 2) is None


class _Driven:
    """A watchdog and the step clock that drives it, as ``worker.callbacks`` builds them:
    Lightning's hooks (``on_...``, ``end_marker``) go to the clock, the rest to the dog."""

    def __init__(self, watchdog: HangWatchdog, clock: Clock):
        self.watchdog, self.hooks = watchdog, StepClock([watchdog], clock=clock)

    def __getattr__(self, name: str) -> Any:
        hook = name.startswith("on_") or name == "end_marker"
        return getattr(self.hooks if hook else self.watchdog, name)


def _watchdog(
    tmp_path: Path,
    clock: Clock,
    sent: list[Event],
    exits: list[int],
    rank: int = 1,
    limits: HangLimits = LIMITS,
) -> Any:
    return _Driven(_make_watchdog(tmp_path, clock, sent, exits, rank, limits), clock)


def _make_watchdog(
    tmp_path: Path,
    clock: Clock,
    sent: list[Event],
    exits: list[int],
    rank: int,
    limits: HangLimits,
) -> HangWatchdog:
    return HangWatchdog(
        limits=limits,
        run_dir=str(tmp_path / "run"),
        options=None,
        rank=rank,
        node="10.0.0.2",
        publish=sent.append,
        clock=clock,
        wall=clock,
        exit=exits.append,
        thread=False,
        grace_s=0,
    )


def _trainer(world_size: int = 1) -> Any:
    strategy = SimpleNamespace(broadcast=lambda value, src: value)
    progress = SimpleNamespace(is_last_batch=False, current=SimpleNamespace(ready=1))
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress))
    return SimpleNamespace(
        world_size=world_size, global_step=0, strategy=strategy, fit_loop=loop, val_check_batch=1000
    )


def _batch(dog: HangWatchdog, trainer: Any, clock: Clock, seconds: float) -> None:
    dog.on_train_batch_start(trainer, None, None, 0)
    clock.now += seconds
    dog.on_train_batch_end(trainer, None, None, None, 0)
    trainer.global_step += 1
    dog.end_marker().on_train_batch_end(trainer, None, None, None, 0)


def test_a_rank_idle_past_its_allowance_writes_its_stacks_reports_and_ends(
    tmp_path: Path,
) -> None:
    clock, sent, exits = Clock(), [], []  # type: ignore[var-annotated]
    dog, trainer = _watchdog(tmp_path, clock, sent, exits), _trainer()
    dog.on_train_start(trainer, None)
    clock.now += 299  # the first batch: 300 s allowed
    assert not dog.check()
    _batch(dog, trainer, clock, 0.0)  # the first batch is not timed
    for _ in range(10):
        _batch(dog, trainer, clock, 0.5)
    assert dog._step_times and max(dog._step_times) == 0.5
    dog.on_train_batch_start(trainer, None, None, 0)  # step 11 starts, never ends
    clock.now += 60
    assert not dog.check() and not sent  # max(60, 20 x 0.5 s): not yet
    clock.now += 0.5
    assert dog.check()
    (report,) = sent
    assert isinstance(report, HangReport)
    assert (report.rank, report.step, report.phase, report.collective) == (1, 11, "forward", None)
    assert report.idle_s == 60.5 and report.allowed_s == 60.0 and exits == [HANG_EXIT]
    text = Path(report.stacks).read_text()
    assert report.stacks.endswith(f"hangs/{report.attempt}/rank1.txt")
    assert text.startswith("raytrain hang report: rank 1 of 1, node 10.0.0.2")
    assert "collective: not in a collective" in text
    # this thread trains here (its hooks ran on it), and is shown first with its frames
    first = text.split("\nThread ")[1]
    assert "(training)" in first and "in test_a_rank_idle_past_its_allowance" in first
    assert threading.current_thread().name in first


def test_saving_and_validation_are_judged_by_their_own_allowances(tmp_path: Path) -> None:
    clock, sent, exits = Clock(), [], []  # type: ignore[var-annotated]
    limits = HangLimits(timeout_s=10.0, first_step_s=300.0, checkpoint_s=120.0)
    dog, trainer = _watchdog(tmp_path, clock, sent, exits, limits=limits), _trainer()
    dog.on_train_start(trainer, None)
    _batch(dog, trainer, clock, 1.0)
    dog.on_train_batch_start(trainer, None, None, 0)
    dog.on_train_batch_end(trainer, None, None, None, 0)  # a checkpoint's save begins
    clock.now += 100
    assert dog.phase == "saving" and not dog.check()
    dog.end_marker().on_train_batch_end(trainer, None, None, None, 0)
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True  # the epoch's last
    _batch(dog, trainer, clock, 1.0)
    clock.now += 200  # the validation's loader starting, before its hooks
    assert dog.phase == "starting" and not dog.check()
    dog.on_validation_start(trainer, None)
    clock.now += 200
    assert not dog.check()
    dog.on_validation_batch_end(trainer, None, None, None, 0)
    clock.now += 10.5
    assert dog.phase == "validation" and dog.check() and exits == [HANG_EXIT]


def test_a_rank_allowed_longer_reports_once_a_peer_wrote_its_stacks(tmp_path: Path) -> None:
    clock, sent, exits = Clock(), [], []  # type: ignore[var-annotated]
    limits = HangLimits(timeout_s=10.0, first_step_s=300.0, checkpoint_s=120.0)
    trainer = _trainer(world_size=2)
    saver = _watchdog(tmp_path, clock, sent, exits, rank=0, limits=limits)
    hung = _watchdog(tmp_path, clock, sent, exits, rank=1, limits=limits)
    for dog in (saver, hung):
        dog.on_train_start(trainer, None)
        _batch(dog, trainer, clock, 0.0)
    saver.on_train_batch_start(trainer, None, None, 0)
    saver.on_train_batch_end(trainer, None, None, None, 0)  # in a save's barrier
    hung.on_train_batch_start(trainer, None, None, 0)
    clock.now += 11
    assert not saver.check()  # 120 s allowed, and no peer's stacks yet
    assert hung.check() and len(sent) == 1
    clock.now += 5  # its next look at the folder
    assert saver.check() and len(sent) == 2 and exits == [HANG_EXIT, HANG_EXIT]
    reports = [e for e in sent if isinstance(e, HangReport)]
    assert {r.attempt for r in reports} == {saver.hangs.token}
    written = sorted(p.name for p in Path(saver.hangs.path).iterdir())
    assert written == ["rank0.sent", "rank0.txt", "rank1.sent", "rank1.txt"]
    assert hang_summary(reports) == (
        "hang at step 2: no batch finished for 11 s; not in a collective: rank 0 in saving, "
        "rank 1 in forward"
    )


def test_the_driver_says_each_report_logs_its_stacks_and_keeps_the_summary(
    tmp_path: Path,
) -> None:
    stacks = tmp_path / "rank1.txt"
    stacks.write_text("the stacks")
    logged, tags, noted = [], [], []  # type: ignore[var-annotated]
    out = tmp_path / "stderr"
    with out.open("w") as stream:
        hangs = Hangs(
            lambda p: Path(p).read_text() if Path(p).exists() else None,
            lambda text, name: logged.append((name, text)),
            tags.append,
            on_hang=noted.append,
            stream=stream,
        )

        def report(rank: int, collective: str | None, attempt: str = "a1") -> HangReport:
            where = stacks if rank == 1 else tmp_path / "missing.txt"
            return HangReport(
                rank=rank,
                world_size=2,
                node="n",
                pid=1,
                step=7,
                phase="forward",
                idle_s=61.0,
                allowed_s=60.0,
                collective=collective,
                attempt=attempt,
                stacks=str(where),
                at=float(rank),
            )

        hangs.on_hang(report(1, None))
        alone = "not in a collective: rank 1 in forward; 1 rank(s) sent no stacks"
        assert noted[-1].endswith(alone)
        hangs.on_hang(report(0, "the gradients' all-reduce (backward)"))
        hangs.on_hang(report(1, None, attempt="a2"))  # a later attempt's hang starts over
    assert noted[1] == (
        "hang at step 7: no batch finished for 61 s; not in a collective: "
        "rank 1 in forward; waiting in a collective: rank 0"
    )
    assert hangs.summaries == [noted[1], noted[2]] and tags[-1] == {"raytrain.hang": noted[2]}
    assert logged == [("hangs/a1/rank1.txt", "the stacks"), ("hangs/a2/rank1.txt", "the stacks")]
    lines = out.read_text().splitlines()
    said = r"raytrain: hang: rank \d \(node n\)"
    assert len(lines) == 3 and all(re.match(said, x) for x in lines)
    assert "stacks: " + str(stacks) in lines[0]


def test_the_progress_line_names_the_straggler(tmp_path: Path) -> None:
    with (tmp_path / "out").open("w") as stream:
        line = ProgressLine(max_epochs=2, max_steps=-1, stream=stream)
        event = Report(step=5, epoch=0, kind="step", world_size=2)
        assert "straggler" not in line.format(event)
        line.straggler = "rank 1 4.0x"
        assert line.format(event).endswith(" | straggler rank 1 4.0x")
