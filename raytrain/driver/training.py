"""The training phase of a run on the driver: datasets, the trainer, and the run's events.

``train`` builds the datasets and Ray Train's configs, opens the run's records while the
workers start (a failure to open them aborts the run; so does another run taking the lease
over), hands the ranks' events to their listeners (the progress line, MLflow, the status
record, the timelines, Ray's metrics), and turns Ray's failures into raytrain's errors.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from raytrain import storage
from raytrain.contract import SCORE_KEY, RunListener, WorkerConfig
from raytrain.driver import preempt_request
from raytrain.driver.hangs import Hangs
from raytrain.driver.progress import Latest, ProgressLine
from raytrain.driver.ray_runtime import RayHandle
from raytrain.driver.results import Trained, worker_errors
from raytrain.driver.run_record import RunRecord
from raytrain.driver.timeline import Straggler, Timelines
from raytrain.errors import (
    PreemptedError,
    RunPreempted,
    RunStateError,
    TrainingFailed,
    root_cause,
    wraps,
)
from raytrain.records.lease import Lease
from raytrain.records.status_record import StatusRecord
from raytrain.spec import JobSpec
from raytrain.tracking.prometheus import RayMetrics

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.train import Result
    from ray.train.v2.api.config import RunConfig

    from raytrain._compat.ray_train import ControllerTrainer
    from raytrain.data.sources import Splits
    from raytrain.driver.chaos import Fault

Mark = Callable[[str], None]


def for_workers(job: JobSpec) -> JobSpec:
    """``job`` as the workers get it: the local locations they open themselves
    (``checkpoint.storage``, under which the user's loggers and the profiler's reports
    go, and ``ckpt_path``) made absolute against this process's directory, since a worker
    is another process, started in the cluster's directory, not necessarily this one."""
    checkpoint = job.checkpoint.model_copy(
        update={"storage": storage.resolve(job.checkpoint.storage)}
    )
    update: dict[str, Any] = {"checkpoint": checkpoint}
    if job.ckpt_path is not None:
        update["ckpt_path"] = storage.resolve(job.ckpt_path)
    return job.model_copy(update=update)


def run_config(job: JobSpec) -> RunConfig:
    """Ray Train's ``RunConfig``: the run folder on the spec's storage, the failure limits,
    and how many checkpoints to keep, ranked by ``SCORE_KEY`` when a metric is monitored."""
    # Ray Train V2's classes, which ray.train exports at run time (mypy reads V1's there)
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, RunConfig

    ckpt = job.checkpoint
    storage_fs, storage_path = storage.filesystem(ckpt.storage, job.storage)
    return RunConfig(
        name=job.name,
        storage_path=storage_path,
        storage_filesystem=storage_fs,
        failure_config=FailureConfig(
            max_failures=job.failure.max_failures,
            max_preemption_failures=job.failure.max_preemptions,
        ),
        checkpoint_config=CheckpointConfig(
            num_to_keep=ckpt.keep,
            checkpoint_score_attribute=SCORE_KEY if ckpt.monitor else None,
            checkpoint_score_order=ckpt.mode,
        ),
    )


def make_trainer(
    job: JobSpec,
    ray_handle: RayHandle,
    sink: ActorHandle,
    splits: Splits,
    chaos: ActorHandle | None = None,
    keeper: ActorHandle | None = None,
) -> ControllerTrainer:
    """The run's trainer: ``worker.entry.train_loop`` on every worker, with its
    ``WorkerConfig``; ``chaos``: ``failure.chaos``'s injector (its kills are retried, not
    counted); ``keeper``: the ``StateKeeper`` of ``checkpoint.memory_every_n_steps``."""
    from ray.train.torch import TorchConfig
    from ray.train.v2.api.config import ScalingConfig

    from raytrain.data.sources import dataset_config
    from raytrain.driver.chaos import ChaosClaim
    from raytrain.driver.progress import SinkNotice, SinkRequested
    from raytrain.driver.trainer import build_trainer
    from raytrain.worker.entry import train_loop

    work = WorkerConfig(
        spec=for_workers(job),
        sink=sink,
        cached=splits.cached,
        streamed=splits.streamed,
        mixed=splits.mixed,
        chaos=chaos,
        keeper=keeper,
    )
    return build_trainer(
        embedded_env=ray_handle.embedded_env,
        ends_with_run=ray_handle.ends_with_run,
        max_preemptions=job.failure.max_preemptions,
        notify=SinkNotice(sink),
        injected=ChaosClaim(chaos) if chaos is not None else None,
        requested=SinkRequested(sink),
        train_loop_per_worker=train_loop,
        train_loop_config=work.as_train_loop_config(),
        torch_config=TorchConfig(backend="nccl" if job.scaling.use_gpu is True else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=job.scaling.num_workers,
            elastic_resize_monitor_interval_s=job.scaling.resize_check_s,
            use_gpu=job.scaling.use_gpu is True,
            resources_per_worker=job.scaling.worker_resources(),
        ),
        run_config=run_config(job),
        datasets=splits.ray_data,
        dataset_config=dataset_config(splits.data_nodes),
    )


def train(
    job: JobSpec,
    ray_handle: RayHandle,
    record: RunRecord,
    held: Lease,
    progress: bool | TextIO,
    mark: Mark,
    listeners: Sequence[RunListener] = (),
    status: StatusRecord | None = None,
) -> Trained:
    """Build the datasets and the trainer, open the run's records while the workers start,
    and train (see the module docstring). ``listeners`` hear every event beside MLflow and
    the progress line (a sweep's trial reports to Ray Tune from them); one may raise
    ``progress.StopRun`` to end the run. The ranks' step timelines go to MLflow,
    their straggler to ``status`` too, and all of them to ``timeline.json`` at the end;
    the ranks' hang reports to stderr, MLflow and ``status``; the reports, timelines and
    hangs also to Ray's metrics (``tracking.prometheus``)."""
    from raytrain.checkpoints.keeper import keeps_memory_state, start_keeper, stop_keeper
    from raytrain.data.sources import build_datasets
    from raytrain.driver.progress import start_sink, stop_sink

    splits = build_datasets(job, ray_handle.object_store_bytes())
    mark("datasets_ready")
    sink = start_sink()
    line = None
    if progress:
        stream = progress if not isinstance(progress, bool) else sys.stderr
        line = ProgressLine(job.trainer.max_epochs, job.trainer.max_steps, stream=stream)
    timelines = _timelines(record, status, line)
    hangs = _hangs(job, record, status)
    chaos = _start_chaos(job)
    keeper = start_keeper() if keeps_memory_state(job) else None
    began = time.time()
    latest = Latest()
    try:
        trainer = make_trainer(job, ray_handle, sink, splits, chaos, keeper)
        # A run that cannot be recorded does not train: opening the records aborts it; so
        # does another run taking the lease over.
        record.start(on_error=lambda exc: trainer.abort())
        held.on_lost = lambda holder: trainer.abort()
        heard = _listeners(job, record, status, line, listeners, timelines, hangs)
        result = _fit(trainer, sink, record, held, line, mark, [*heard, latest])
    finally:
        stop_sink(sink)
        stop_keeper(keeper)
        if keeper is not None:  # however training ended: no node copy outlives it
            _clear_node_copies(job)
        _log_timelines(record, timelines)
        faults = _stop_chaos(chaos)
    summary = None
    if faults is not None and job.failure.chaos is not None:
        summary = _chaos_summary(job, record, faults, time.time() - began, latest)
    return Trained(
        result=result,
        latest=latest.values,
        data_paths=splits.paths(),
        chaos=summary,
        startup=latest.startup,
        stopped=latest.stopped,
    )


def _listeners(
    job: JobSpec,
    record: RunRecord,
    status: StatusRecord | None,
    line: ProgressLine | None,
    listeners: Sequence[RunListener],
    timelines: Timelines,
    hangs: Hangs,
) -> list[RunListener]:
    """Who hears the run's events, in this order: MLflow (``record``), the caller's
    ``listeners``, the progress line, the status record, the timelines, the hangs, and
    Ray's metrics (``tracking.prometheus``)."""
    heard: list[RunListener] = [record, *listeners]
    heard += [line] if line is not None else []
    heard += [status] if status is not None else []
    heard += [timelines, hangs]
    if job.tracking.prometheus:
        heard.append(RayMetrics(job.name))
    return heard


def _start_chaos(job: JobSpec) -> ActorHandle | None:
    """``failure.chaos``'s injector (``driver.chaos``), or None."""
    if job.failure.chaos is None:
        return None
    from raytrain.driver.chaos import start_chaos

    return start_chaos(job.failure.chaos.mtbf_s, job.failure.chaos.seed)


def _stop_chaos(chaos: ActorHandle | None) -> list[Fault] | None:
    if chaos is None:
        return None
    from raytrain.driver.chaos import stop_chaos

    return stop_chaos(chaos)


def _chaos_summary(
    job: JobSpec, record: RunRecord, faults: list[Fault], wall_s: float, latest: Latest
) -> dict[str, Any]:
    """The injected faults and what they cost: printed, and in MLflow (``chaos/...`` at the
    last step, ``chaos.json``)."""
    from raytrain.driver.chaos import chaos_summary

    assert job.failure.chaos is not None
    step = int(latest.values.get("step", 0))
    summary = chaos_summary(faults, job.failure.chaos.mtbf_s, job.failure.chaos.seed, wall_s, step)
    for text in summary.lines():
        print(f"raytrain: {text}" if not text.startswith(" ") else text, file=sys.stderr)
    tracker = record.tracker()
    tracker.log_metrics(summary.metrics(), step=step)
    tracker.log_text(json.dumps(summary.as_dict(), indent=1), "chaos.json")
    return summary.as_dict()


def _timelines(
    record: RunRecord, status: StatusRecord | None, line: ProgressLine | None
) -> Timelines:
    """The handler of the ranks' timelines: per rank into MLflow, the straggler also into
    the status record and onto the progress line."""

    def named(found: Straggler | None) -> None:
        if status is not None:
            status.set_straggler(found.describe() if found else None)
        if line is not None:
            line.straggler = f"rank {found.rank} {found.factor:.1f}x" if found else None

    return Timelines(
        lambda metrics, step: record.tracker().log_metrics(metrics, step=step),
        lambda tags: record.tracker().set_tags(tags),
        on_straggler=named,
    )


def _hangs(job: JobSpec, record: RunRecord, status: StatusRecord | None) -> Hangs:
    """The handler of the ranks' hang reports: stderr, MLflow, the status record."""
    return Hangs(
        lambda location: storage.read_text(location, job.storage),
        lambda text, name: record.tracker().log_text(text, name),
        lambda tags: record.tracker().set_tags(tags),
        on_hang=status.note_hang if status is not None else lambda summary: None,
    )


def _log_timelines(record: RunRecord, timelines: Timelines) -> None:
    """Every rank's timeline windows as the run's ``timeline.json`` artifact, whatever the
    run's end (nothing if the records never opened)."""
    if not timelines.windows:
        return
    try:
        record.tracker().log_text(json.dumps(timelines.summary(), indent=1), "timeline.json")
    except Exception:  # the run's records failed: that error is the run's, raised elsewhere
        return


def _fit(
    trainer: ControllerTrainer,
    sink: ActorHandle,
    record: RunRecord,
    held: Lease,
    line: ProgressLine | None,
    mark: Mark,
    listeners: Sequence[RunListener],
) -> Result:
    """``trainer.fit()`` with the ranks' events pumped to ``listeners``; returns Ray's
    result."""
    from ray.train import TrainingFailedError

    from raytrain._compat.ray_train import RunAborted
    from raytrain.driver.progress import ReportPump

    try:
        pump = ReportPump(sink, listeners, on_stop=trainer.abort)
        # SIGUSR1 to this process: the ranks stop at a committed checkpoint
        with pump, preempt_request.forwarding(sink):
            result = trainer.fit()
            mark("trained")
    except RunAborted:
        if pump.stopped is not None:
            raise pump.stopped.error from None
        if held.lost_to is not None:
            raise RunStateError(
                f"name: {held.path} was taken over by another run "
                f"({held.lost_to.describe(time.time())}); this run stopped"
            ) from None
        record.tracker()  # raises why the run was aborted
        raise
    except TrainingFailedError as exc:
        raise _failed(exc) from exc
    finally:
        if line is not None:
            line.close()
    record.tracker()
    if pump.stopped is not None:  # a listener's stop in the last drain, after training
        raise pump.stopped.error
    if result.error is not None:
        raise _failed(result.error)
    if pump.errors:  # training finished; say what the progress line or MLflow missed
        print(
            f"raytrain: warning: {len(pump.errors)} metric report(s) were not recorded; "
            f"first: {type(pump.errors[0]).__name__}: {pump.errors[0]}",
            file=sys.stderr,
        )
    return result


def _failed(error: BaseException) -> TrainingFailed:
    """Ray's error of a run that did not finish, as raytrain's: ``RunPreempted`` when the
    ranks stopped at a checkpoint because the driver was asked to (the failure policy
    raises a preemption only then), ``TrainingFailed`` otherwise."""
    ranks = list((getattr(error, "worker_failures", None) or {}).values()) or [error]
    if preempt_request.requested() and all(wraps(e, PreemptedError) for e in ranks):
        return RunPreempted(f"stopped on request (SIGUSR1): {root_cause(ranks[0])}")
    return TrainingFailed(worker_errors(error))


def _clear_node_copies(job: JobSpec) -> None:
    """Remove the run's node copies of the in-memory state on every node; a failure is
    warned about, never raised (the run's result stands)."""
    from raytrain.checkpoints.layout import run_dir
    from raytrain.checkpoints.node_slots import clear_on_every_node, keep_scratch_name

    try:
        clear_on_every_node(keep_scratch_name(run_dir(job)))
    except Exception as exc:
        print(
            f"raytrain: warning: the in-memory state's node copies were not all removed "
            f"({type(exc).__name__}: {exc})",
            file=sys.stderr,
            flush=True,
        )
