"""The worker's Lightning callbacks, built with every feature on, in the order
``worker.callbacks`` documents: Lightning runs each hook down this list, so a callback
moved is a behaviour changed (a report before its batch is counted, a checkpoint without
the user's EarlyStopping state, a timer that misses a hook)."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import EarlyStopping

from raytrain.checkpoints.layout import run_dir
from raytrain.contract import Event, Startup
from raytrain.spec import JobSpec
from raytrain.worker.callbacks import build_callbacks
from raytrain.worker.hang_watchdog import HangWatchdog
from raytrain.worker.step_clock import StepClock
from raytrain.worker.step_timeline import StepTimeline
from tests.conftest import digits_spec

ORDER = [
    "StepClock",
    "FiniteGuard",
    "SpikeGuard",
    "MixRows",
    "MetricsReporter",
    "EarlyStopping",  # the user's, before the checkpoint that holds its state
    "CheckpointCallback",
    "KeepAlone",
    "PreemptionGuard",
    "LoaderPosition",
    "RollbackSkip",
    "AccumulationAlignment",
    "BatchEnd:StepClock",
]
# what hears the step clock's marks, in the order it tells them
TIMERS = ["SystemMetrics", "StepTimeline", "HangWatchdog"]


def _name(callback: object) -> str:
    """A callback's class, and for an end marker whose timer it ends."""
    owner = getattr(getattr(callback, "done", None), "__self__", None)
    kind = type(callback).__name__
    return f"{kind}:{type(owner).__name__}" if owner is not None else kind


def test_every_feature_on_builds_the_callbacks_in_their_documented_order(tmp_path: Path) -> None:
    spec = JobSpec.model_validate(
        digits_spec(
            tmp_path,
            tmp_path,
            checkpoint={"storage": str(tmp_path / "runs"), "memory_every_n_steps": 5},
            failure={"spike": {}, "hang_timeout_s": 60},
        )
    )
    sent: list[Event] = []
    timeline = StepTimeline(every_n_steps=5, publish=sent.append, rank=0, node="n")
    watchdog = HangWatchdog(
        limits=spec.failure.hang_limits(),
        run_dir=run_dir(spec),
        options=spec.storage,
        rank=0,
        node="n",
        publish=sent.append,
        thread=False,
    )
    built = build_callbacks(
        spec,
        lambda: None,
        sent.append,  # rank 0: it reports, and times its loop
        Startup(marks={}, resumed_step=0, precision="32-true"),
        timeline,
        watchdog,
        user=[EarlyStopping(monitor="val_loss")],
        keeper=object(),
    )
    assert [_name(c) for c in built.ordered] == ORDER
    clock = built.ordered[0]
    assert isinstance(clock, StepClock)
    assert [type(t).__name__ for t in clock.listeners] == TIMERS
    assert clock.listeners[1:] == [timeline, watchdog]
    assert built.reporter is built.ordered[ORDER.index("MetricsReporter")]
    assert built.checkpoints is built.ordered[ORDER.index("CheckpointCallback")]
