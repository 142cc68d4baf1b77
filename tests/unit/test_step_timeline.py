"""Each rank's step timeline, driven hook by hook through a step clock of its own (no
Trainer), and the driver's comparison of the ranks: which one is a straggler, and when it
is named."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace
from typing import Any

import pytest

from raytrain._compat.torch_collectives import CollectiveTimer
from raytrain.contract import TimelineWindow
from raytrain.driver.timeline import Timelines, factors, straggler_in
from raytrain.worker.step_clock import StepClock
from raytrain.worker.step_timeline import StepTimeline, summarize


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _clock_of(
    timeline: StepTimeline, clock: Clock, collectives: CollectiveTimer | None = None
) -> StepClock:
    """The step clock that drives ``timeline`` (as ``worker.loop`` builds it)."""
    return StepClock([timeline], clock=clock, collectives=collectives)


def _batch(
    timeline: StepTimeline,
    clock: Clock,
    trainer: Any,
    *,
    data: float,
    fwd: float,
    grads: float,
    wait: float,
    opt: float,
    hooks: float,
) -> None:
    """One batch through the hooks in Lightning's order, each part taking its seconds."""
    hooks_of = _clock_of(timeline, clock)
    clock.now += data
    hooks_of.on_train_batch_start(trainer, None, None, 0)
    clock.now += fwd
    hooks_of.on_before_backward(trainer, None, None)
    clock.now += grads
    timeline.grads_ready()  # the last bucket's hook
    clock.now += wait
    hooks_of.on_after_backward(trainer, None)
    hooks_of.on_before_optimizer_step(trainer, None, None)
    clock.now += opt
    hooks_of.on_train_batch_end(trainer, None, None, None, 0)
    clock.now += hooks
    trainer.global_step += 1
    hooks_of.end_marker().on_train_batch_end(trainer, None, None, None, 0)


def test_a_batch_is_split_into_its_parts_and_a_window_is_sent_every_n_steps() -> None:
    clock, sent = Clock(), []
    timeline = StepTimeline(
        every_n_steps=2, publish=sent.append, rank=1, node="10.0.0.2", clock=clock
    )
    timeline.comm_measured = True
    trainer = SimpleNamespace(global_step=0, world_size=2)
    parts = {"data": 0.5, "fwd": 1.0, "grads": 2.0, "wait": 4.0, "opt": 0.25, "hooks": 0.125}
    _batch(timeline, clock, trainer, **parts)
    assert sent == []
    _batch(timeline, clock, trainer, **parts)
    (event,) = sent
    assert (event.rank, event.node, event.step, event.world_size) == (
        1,
        "10.0.0.2",
        2,
        2,
    )
    got = {part: pair[0] for part, pair in event.parts.items()}
    # the first batch had no data wait (nothing before it); the second waited 0.5 s
    assert got == {
        "data_wait": 0.25,
        "forward": 1.0,
        "backward": 2.0,
        "comm_wait": 4.0,
        "optimizer": 0.25,
        "hooks": 0.125,
        "busy": 3.5,
        "step": 7.625,
    }
    assert event.parts["data_wait"][1:] == [0.5, 0.25]  # its p90 and mean


class Collectives(CollectiveTimer):
    """A timer whose ``total`` the test moves: the seconds a collective held the rank."""

    def wait(self, clock: Clock, seconds: float) -> None:
        clock.now += seconds
        self.total += seconds


def test_a_wait_in_a_collective_inside_the_step_is_comm_wait_not_the_ranks_own_work() -> None:
    """The fast rank of a model whose ``training_step`` all-reduces (its own counter,
    ``self.log(sync_dist=True)``) waits there for the slow rank: that wait is ``comm_wait``,
    and its forward and busy time stay its own work, so the slow rank stands out."""
    clock, sent = Clock(), []
    collectives = Collectives(clock)
    timeline = StepTimeline(every_n_steps=1, publish=sent.append, rank=0, node="n", clock=clock)
    hooks_of = _clock_of(timeline, clock, collectives)
    timeline.comm_measured = True
    trainer = SimpleNamespace(global_step=0, world_size=2)
    hooks_of.on_train_batch_start(trainer, None, None, 0)
    clock.now += 0.010
    collectives.wait(clock, 0.060)  # the step's own all-reduce, behind a rank 60 ms late
    clock.now += 0.005
    hooks_of.on_before_backward(trainer, None, None)
    clock.now += 0.010
    collectives.wait(clock, 0.002)  # a collective in backward (SyncBatchNorm's)
    hooks_of.on_after_backward(trainer, None)
    hooks_of.on_before_optimizer_step(trainer, None, None)
    clock.now += 0.003
    collectives.wait(clock, 0.001)  # and one in the optimizer step (ZeRO's gather)
    hooks_of.on_train_batch_end(trainer, None, None, None, 0)
    trainer.global_step += 1
    hooks_of.end_marker().on_train_batch_end(trainer, None, None, None, 0)
    got = {part: round(values[0], 6) for part, values in sent[0].parts.items()}
    assert got["forward"] == 0.015 and got["backward"] == 0.010 and got["optimizer"] == 0.003
    assert got["comm_wait"] == 0.063 and got["busy"] == 0.028


def test_two_backward_passes_in_a_batch_count_each_collective_wait_once() -> None:
    """Manual optimization (two ``manual_backward`` calls): the forward before each is
    the rank's own, and a collective in the first backward is counted there only."""
    clock, sent = Clock(), []
    collectives = Collectives(clock)
    timeline = StepTimeline(every_n_steps=1, publish=sent.append, rank=0, node="n", clock=clock)
    hooks_of = _clock_of(timeline, clock, collectives)
    timeline.comm_measured = True
    trainer = SimpleNamespace(global_step=0, world_size=2)
    hooks_of.on_train_batch_start(trainer, None, None, 0)
    for fwd, bwd, wait in ((1.0, 0.5, 0.25), (0.5, 0.5, 0.0)):
        clock.now += fwd
        hooks_of.on_before_backward(trainer, None, None)
        clock.now += bwd
        collectives.wait(clock, wait)
        hooks_of.on_after_backward(trainer, None)
    hooks_of.on_train_batch_end(trainer, None, None, None, 0)
    trainer.global_step += 1
    hooks_of.end_marker().on_train_batch_end(trainer, None, None, None, 0)
    got = {part: values[0] for part, values in sent[0].parts.items()}
    assert (got["forward"], got["backward"], got["comm_wait"]) == (1.5, 1.0, 0.25)
    assert got["busy"] + got["comm_wait"] == got["step"] == 2.75


def test_a_failed_fit_puts_torchs_collectives_back() -> None:
    """Lightning runs no callback's ``teardown`` when ``fit`` raises: ``on_exception``
    removes the timer's wrappers."""
    import torch.distributed as dist

    original = dist.all_reduce
    timeline = StepTimeline(every_n_steps=1, publish=None, rank=0, node="n")
    hooks_of = StepClock([timeline])
    hooks_of.on_train_start(SimpleNamespace(strategy=None, world_size=2), None)
    assert dist.all_reduce is not original
    hooks_of.on_exception(SimpleNamespace(), None, RuntimeError("a NaN"))
    assert dist.all_reduce is original


def test_validation_is_not_a_wait_for_data_and_unmeasured_comm_is_not_sent() -> None:
    clock, sent = Clock(), []
    timeline = StepTimeline(every_n_steps=2, publish=sent.append, rank=0, node="n", clock=clock)
    trainer = SimpleNamespace(global_step=0, world_size=1)
    parts = {"data": 0.0, "fwd": 1.0, "grads": 1.0, "wait": 0.0, "opt": 0.0, "hooks": 0.0}
    _batch(timeline, clock, trainer, **parts)
    hooks_of = _clock_of(timeline, clock)
    hooks_of.on_validation_start(trainer, None)
    _batch(timeline, clock, trainer, **{**parts, "data": 9.0})  # 9 s of validation between
    (event,) = sent
    assert event.parts["data_wait"] == [0.0, 0.0, 0.0]
    assert "comm_wait" not in event.parts  # no DDP hook: not measured, not zero


def test_summarize_gives_the_median_and_the_nearest_rank_p90() -> None:
    assert summarize({"step": [float(v) for v in range(1, 11)], "none": []}) == {
        "step": [5.5, 9.0, 5.5]
    }


def test_a_straggler_is_a_rank_slow_in_every_one_of_the_last_windows() -> None:
    assert factors({0: 1.0, 1: 4.0, 2: 1.0}) == {0: 0.4, 1: 4.0, 2: 0.4}
    slow = {0: 1.0, 1: 4.0}
    assert straggler_in([slow, slow]) is None  # 2 windows are not 3
    assert straggler_in([slow, {0: 1.0, 1: 1.2}, slow, slow]) is None  # not every one
    assert straggler_in([slow, slow, slow]) == (1, 4.0)
    assert straggler_in([{0: 1.0}] * 3) is None  # one rank has no others


def test_timelines_log_each_rank_name_the_straggler_once_and_clear_it() -> None:
    logged: list[tuple[dict[str, float], int]] = []
    tags: list[dict[str, str]] = []
    told: list[Any] = []
    timelines = Timelines(lambda m, s: logged.append((m, s)), tags.append, told.append)

    def window(step: int, busy: dict[int, float]) -> None:
        for rank, value in busy.items():
            timelines.on_timeline(
                TimelineWindow(
                    rank=rank,
                    node=f"n{rank}",
                    step=step,
                    world_size=len(busy),
                    parts={"busy": [value, value]},
                )
            )

    for step in (5, 10):
        window(step, {0: 0.01, 1: 0.04})
    assert told == [] and logged[0] == (
        {"timeline/rank0/busy_p50_s": 0.01, "timeline/rank0/busy_p90_s": 0.01},
        5,
    )
    window(15, {0: 0.01, 1: 0.04})
    window(20, {0: 0.01, 1: 0.05})
    assert [t.rank for t in told] == [1, 1] and told[-1].factor == pytest.approx(5.0)
    assert len(tags) == 1 and tags[0]["raytrain.straggler"].startswith("rank 1 on n1: 4.0x")
    window(25, {0: 0.01, 1: 0.011})  # caught up
    assert told[-1] is None and timelines.straggler is None
    summary = timelines.summary()
    assert [w["step"] for w in summary["windows"]] == [5, 10, 15, 20, 25]
    assert [s["rank"] for s in summary["stragglers"]] == [1]


def test_the_comm_hook_registers_on_a_real_ddp_model_and_marks_each_bucket() -> None:
    """DDP checks a hook's annotations against its own classes: one it refuses fails every
    rank's first step."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = timeline = trainer = None
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        timeline = StepTimeline(every_n_steps=1, publish=None, rank=0, node="n")
        trainer = SimpleNamespace(strategy=SimpleNamespace(model=model), world_size=1)
        StepClock([timeline]).on_train_start(trainer, None)
        assert timeline.comm_measured
        model(torch.ones(3, 4)).sum().backward()
        assert timeline._ready_at is not None  # the bucket's mark
        assert model.module.weight.grad is not None  # torch's all-reduce still ran
    finally:
        # DDP's reducer holds the group, so it goes first. Destroyed after the group, it
        # joined gloo's threads at the test's end and hung there (two clean-clone CI runs).
        # ``del model`` alone did not free it: the trainer and the timeline's hooks (a
        # cycle) still held it. So every holder is dropped and collected, and the test
        # checks that the model is gone before the group is destroyed.
        held = weakref.ref(model) if model is not None else None
        model = timeline = trainer = None
        gc.collect()
        alive = held is not None and held() is not None
        if not alive:
            dist.destroy_process_group()
    assert not alive, "DDP's model outlived the test: its reducer would hang on the group"
