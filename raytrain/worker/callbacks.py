"""The callbacks of a worker's Lightning Trainer, built in one place, in their order.

Lightning calls each hook on the callbacks in list order, and the order matters:

1. ``SystemMetrics`` (rank 0), ``StepTimeline`` and ``HangWatchdog`` (every rank) first,
   to start timing a batch before anything else runs (and, for the timeline and the
   watchdog, to end its optimizer step before any batch-end hook),
2. ``FiniteGuard``, before any callback acts on a step whose gradients are not finite, and
   ``SpikeGuard`` (``failure.spike``), before any callback reports or checkpoints a step
   whose loss spiked,
3. ``MixRows`` (a mixed train set), whose counts are then in the report of this step,
   and ``MetricsReporter``, which counts the batch's samples before a report of this step,
4. the user's ``trainer.callbacks``, in their order, before the checkpoint: a checkpoint
   taken at a validation's end holds what an EarlyStopping made of that validation (with
   them after it, a resume restored their state one validation behind),
5. ``CheckpointCallback``, whose report of a step includes them, then ``MemoryState``
   (``checkpoint.memory_every_n_steps``: rank 0 under DDP, every rank under FSDP and
   model parallelism), whose state of a step is a checkpoint's,
6. ``PreemptionGuard``, which may checkpoint through 5 and then stop the run,
7. ``LoaderPosition``, the loader's data position, then ``RollbackSkip``, which moves a
   restored loader past the last spike (after ``LoaderPosition`` has set an epoch's
   start), and ``AccumulationAlignment``, where an accumulation of gradients starts after
   an elastic restart,
8. the end markers of ``HangWatchdog``, ``StepTimeline`` and ``SystemMetrics`` last, to
   stop timing after every other hook.

``tests/unit/test_callback_order.py`` builds the list with every feature on and pins this
order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from raytrain.checkpoints.interval import FIRST_AUTO_STEPS, AutoInterval
from raytrain.checkpoints.layout import run_dir
from raytrain.checkpoints.node_slots import keep_scratch_name
from raytrain.contract import Publish, Startup
from raytrain.spec import JobSpec
from raytrain.spec.global_batch import GlobalBatch
from raytrain.worker.accumulation import AccumulationAlignment
from raytrain.worker.checkpointing import CheckpointCallback
from raytrain.worker.comm_hooks import Compression
from raytrain.worker.guards import FiniteGuard, PreemptionGuard
from raytrain.worker.hang_watchdog import HangWatchdog
from raytrain.worker.loader_position import LoaderPosition
from raytrain.worker.memory_state import KeepAlone, KeepTogether, MemoryState
from raytrain.worker.mix_rows import MixRows
from raytrain.worker.reporting import MetricsReporter
from raytrain.worker.schedule import CheckpointSchedule
from raytrain.worker.spike import RollbackSkip, SpikeGuard
from raytrain.worker.step_clock import StepClock
from raytrain.worker.step_timeline import StepTimeline
from raytrain.worker.strategy import (
    compression,
    rank_zero_holds_state,
    shards_checkpoints,
)
from raytrain.worker.system_metrics import SystemMetrics


def _reports_and_checkpoints(
    spec: JobSpec,
    train_loader: Callable[[], Any],
    publish: Publish | None,
    startup: Startup,
    system: SystemMetrics | None,
    batching: GlobalBatch | None,
    mtbf: Callable[[], float | None] | None,
) -> tuple[MetricsReporter, CheckpointCallback]:
    """The reporter and the checkpoint callback, on one schedule: ``checkpoint.every_n_steps``
    (``auto``: from the expected or measured time between failures) and ``every_n_epochs``."""
    ckpt = spec.checkpoint
    auto = AutoInterval(*spec.failure.expected_mtbf()) if ckpt.every_n_steps == "auto" else None
    first = FIRST_AUTO_STEPS if ckpt.every_n_steps == "auto" else ckpt.every_n_steps
    schedule = CheckpointSchedule(first, ckpt.every_n_epochs)
    reporter = MetricsReporter(
        log_every_n_steps=spec.trainer.log_every_n_steps,
        schedule=schedule,
        monitor=ckpt.monitor,
        mode=ckpt.mode,
        publish=publish,
        startup=startup,
        system=system,
        global_batch=batching.samples if batching is not None else None,
        readers_per_row=spec.strategy.replica_size,
    )
    checkpoints = CheckpointCallback(
        schedule=schedule,
        reporter=reporter,
        upload=ckpt.upload,
        sharded=shards_checkpoints(spec),
        train_loader=train_loader,
        auto=auto,
        mtbf=mtbf,
    )
    return reporter, checkpoints


def _memory_state(
    spec: JobSpec,
    train_loader: Callable[[], Any],
    publish: Publish | None,
    reporter: MetricsReporter,
    keeper: Any,
    token: int,
    key: int,
) -> MemoryState | None:
    """``checkpoint.memory_every_n_steps``: the callback keeping this rank's state in the
    run's ``keeper`` (rank 0 under DDP, every rank where each holds a shard); None: no
    keeper, or not this rank."""
    together = not rank_zero_holds_state(spec)  # every rank keeps its shard
    if keeper is None or not (publish is not None or together):  # DDP: rank 0 alone
        return None
    steps = spec.checkpoint.memory_every_n_steps
    way = KeepTogether if together else KeepAlone
    return way(
        keeper,
        token,
        steps if isinstance(steps, int) else None,
        train_loader,
        on_choice=lambda choice: setattr(reporter, "memory_choice", choice.describe()),
        scratch=keep_scratch_name(run_dir(spec)),
        key=key,
    )


def _spike_guards(
    spec: JobSpec,
    train_loader: Callable[[], Any],
    publish: Publish | None,
    keeping: MemoryState | None,
) -> list[pl.Callback]:
    """``failure.spike``: the guard that finds a spike (before any report) and the skip
    that moves a restored loader past it (after the loader's position); [] when off."""
    spike = spec.failure.spike
    if spike is None:
        return []
    where = run_dir(spec)
    forget = keeping.forget if keeping is not None else None
    return [
        SpikeGuard(spike, where, spec.storage, train_loader, forget),
        RollbackSkip(where, spec.storage, train_loader, publish),
    ]


@dataclass(frozen=True)
class WorkerCallbacks:
    """The callbacks, in order (``ordered``), and the ones the loop talks to by name."""

    ordered: list[pl.Callback]
    reporter: MetricsReporter
    checkpoints: CheckpointCallback


def build_callbacks(
    spec: JobSpec,
    train_loader: Callable[[], Any],
    publish: Publish | None,
    startup: Startup,
    timeline: StepTimeline | None,
    watchdog: HangWatchdog | None = None,
    batching: GlobalBatch | None = None,
    mtbf: Callable[[], float | None] | None = None,
    user: list[pl.Callback] | None = None,
    keeper: Any = None,
    keeper_token: int = 0,
    keeper_key: int = 0,
) -> WorkerCallbacks:
    """This worker's callbacks for ``spec``; ``publish`` is set on rank 0 only (it sends
    events to the driver), which also times its loop; ``timeline`` times every rank's
    steps (None: ``tracking.timeline`` is off); ``watchdog`` finds the rank hung (None:
    ``failure.hang_timeout_s`` is 0); the three hear one ``StepClock``, first among the
    callbacks, its end marker last. ``train_loader`` returns the train loader, once
    there is one. ``batching``: what a step trains on, reported as ``global_batch``.
    ``mtbf``: the run's measured mean time between failures (rank 0's), for
    ``checkpoint.every_n_steps: auto``. ``user``: the config's ``trainer.callbacks``, built
    (``lightning_config.instantiate``). ``keeper``: the run's ``StateKeeper`` (None: no
    in-memory state), which rank 0 keeps its state in, with ``keeper_token`` and
    ``keeper_key`` (what ``memory_state.restore_from_memory`` opened it with)."""
    system = SystemMetrics() if publish is not None else None
    reporter, checkpoints = _reports_and_checkpoints(
        spec, train_loader, publish, startup, system, batching, mtbf
    )
    preemption = PreemptionGuard(checkpoints, spec.failure.preemption_check_s)
    keeping = _memory_state(spec, train_loader, publish, reporter, keeper, keeper_token, keeper_key)
    memory: list[pl.Callback] = [keeping] if keeping is not None else []
    spikes = _spike_guards(spec, train_loader, publish, keeping)
    timers = [t for t in (system, timeline, watchdog) if t is not None]
    clock = [StepClock(timers)] if timers else []  # first, and its end marker last
    compress = _compression(spec, timeline)
    ordered: list[pl.Callback] = [
        *clock,
        *compress,
        FiniteGuard(),
        *spikes[:1],
        MixRows(train_loader, spec.trainer.log_every_n_steps),
        reporter,
        *(user or []),
        checkpoints,
        *memory,
        preemption,
        LoaderPosition(train_loader),
        *spikes[1:],
        AccumulationAlignment(),
        *[c.end_marker() for c in clock],
    ]
    return WorkerCallbacks(ordered=ordered, reporter=reporter, checkpoints=checkpoints)


def _compression(spec: JobSpec, timeline: StepTimeline | None) -> list[pl.Callback]:
    """The gradient compression's callback, if the run has one; the step timeline then
    registers the compression's hook state with itself in it (one DDP hook does both)."""
    ddp = compression(spec)
    if ddp is None:
        return []
    callback = Compression(ddp)
    if timeline is not None:
        timeline.hook_state = callback.state
    return [callback]
