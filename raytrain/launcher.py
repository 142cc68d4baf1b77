"""Driver side of a run: spec -> preflight -> Ray -> datasets -> TorchTrainer -> result.

``fit`` is the one entry point: the CLI calls it, pipelines call it. It stops with a
``SpecError`` (exit 2) before Ray starts or anything is written when the spec is bad; it
resumes a run from its latest committed checkpoint when the same name and storage ran before.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from raytrain import preflight, ray_runtime, runstate, source_check, storage
from raytrain.background import Background
from raytrain.checkpoint import (
    MONITOR_MISSING,
    SCORE_KEY,
    latest_committed,
    read_snapshot,
    uncommitted,
)
from raytrain.errors import RunStateError, TrainingFailed
from raytrain.lease import Lease, check_free
from raytrain.run_record import RunRecord
from raytrain.spec import JobSpec, load_spec
from raytrain.tracking import redact

logger = logging.getLogger(__name__)


@dataclass
class FitResult:
    """What a finished run produced."""

    name: str
    metrics: dict[str, Any]
    best_checkpoint_uri: str | None
    latest_checkpoint_uri: str | None
    mlflow_run_id: str | None
    tracking_uri: str | None
    run_dir: str
    resumed_from: str | None = None
    wall_time_s: float = 0.0
    checkpoints: list[str] = field(default_factory=list)
    # seconds from the start of fit() to the end of each phase (startup breakdown)
    timings: dict[str, float] = field(default_factory=dict)
    # how each split reached the workers: "cached" (object store, read once) or "streamed"
    data_paths: dict[str, str] = field(default_factory=dict)
    # the trained model in MLflow (runs:/... or models:/...), when it was logged
    model_uri: str | None = None
    # the run had trained to its limits already: nothing was started, trained or logged
    already_complete: bool = False


def validate(
    spec: str | os.PathLike[str] | Mapping[str, Any] | JobSpec, overrides: Iterable[str] = ()
) -> JobSpec:
    """Load and check ``spec`` as ``fit`` would, writing nothing; raises ``SpecError``."""
    job = _check_before_ray(load_spec(spec, overrides))
    preflight.raise_if(preflight.check_model(job))
    return job


def _check_before_ray(job: JobSpec) -> JobSpec:
    """Every check that needs no import of the model's code (cheap: a spec, file footers,
    the machine); the model's import is checked while Ray starts (``fit``) or after."""
    capacity = None if ray_runtime.joins_cluster() else preflight.local_capacity(job)
    preflight.raise_if(
        preflight.check_model_located(job)
        + preflight.check_strategy(job)
        + (preflight.check_capacity(job, capacity) if capacity is not None else [])
        + (preflight.check_local_cpus(job) if capacity is not None else [])
        + preflight.check_stores(job, allow_prepare=True)
    )
    return job


def _prepare_data(spec: JobSpec) -> None:
    """Run ``data.prepare`` when the train set is missing, then check what it wrote.

    ``validate`` has already checked data that existed; only freshly written data is new.
    """
    train = storage.resolve(spec.data.train.uri)
    if spec.data.prepare and not storage.exists(train, spec.storage):
        val = storage.resolve(spec.data.val.uri) if spec.data.val else None
        print(f"raytrain: writing {redact(train)} with {spec.data.prepare}", file=sys.stderr)
        preflight.import_object(spec.data.prepare)(train, val)
        preflight.raise_if(preflight.check_data(spec))


def _check_resumable(spec: JobSpec, fresh: bool, resume_anyway: bool) -> runstate.RunState | None:
    """The run's recorded state; refuses, before anything starts, to continue a run whose
    spec changed, or whose state file cannot be read. With ``fresh`` the state file may hold
    anything: a placeholder state stands for it, so that ``_open_run`` deletes the folder."""
    try:
        state = runstate.load(spec)
    except RunStateError:
        if not fresh:
            raise
        return runstate.new_state(spec)
    if state is not None and not fresh and not resume_anyway:
        runstate.check_resumable(state, spec)
    return state


def _check_run_folder(spec: JobSpec, fresh: bool, force: bool) -> None:
    """Refuse, before anything starts, a run folder that another live run holds (see
    ``lease``), or whose checkpoint snapshot cannot be read (unless ``fresh`` deletes it)."""
    check_free(runstate.run_dir(spec), spec.storage, force=force)
    if not fresh:
        read_snapshot(runstate.run_dir(spec), spec.storage)


def _open_run(
    spec: JobSpec, state: runstate.RunState | None, fresh: bool, held: Lease
) -> runstate.RunState | None:
    """The run's recorded ``state`` to continue; with ``fresh``, its folder is deleted (and
    the lease, which it held, written again)."""
    if state is not None and fresh:
        storage.delete_dir(runstate.run_dir(spec), spec.storage)
        held.rewrite()
        print(f"raytrain: --fresh: deleted {runstate.run_dir(spec)}", file=sys.stderr)
        return None
    return state


def _trained_to_limits(metrics: Mapping[str, Any], job: JobSpec) -> bool:
    """Whether a checkpoint reported with ``metrics`` is where Lightning's fit loop stops
    under ``job``'s limits, so that resuming from it trains nothing.

    Lightning stops when ``global_step >= max_steps`` (unless -1), or when the epochs it has
    processed reach ``max_epochs`` (None: 1000 without max_steps, else unbounded). The
    checkpoint's ``epoch`` is ``trainer.current_epoch`` when it was taken: at an epoch's
    end (``kind: epoch``) that epoch is processed but not yet counted, so it is one more;
    at the end of training (``kind: end``) it counts every epoch; a mid-epoch checkpoint
    (``kind: step``) has not finished its epoch. Any other report is not called complete.
    """
    kind, epoch, step = metrics.get("kind"), metrics.get("epoch"), metrics.get("step")
    if kind not in ("epoch", "end", "step") or not isinstance(epoch, int | float):
        return False
    if not isinstance(step, int | float):
        return False
    t = job.trainer
    if t.max_steps != -1 and step >= t.max_steps:
        return True
    max_epochs = t.max_epochs if t.max_epochs is not None else (1000 if t.max_steps == -1 else -1)
    processed = int(epoch) + 1 if kind == "epoch" else int(epoch)
    return max_epochs != -1 and processed >= max_epochs


def _already_complete(
    job: JobSpec, state: runstate.RunState | None, start: float
) -> FitResult | None:
    """A finished run's command run again, with nothing left to train: say so, and how to
    train more, before Ray starts (it would start the workers, restore, train nothing and
    log the model again). None when there is something to train, or the last attempt did
    not finish (it resumes, and logs the model it may not have logged)."""
    if state is None or state.status != "FINISHED":
        return None
    latest = latest_committed(runstate.run_dir(job), job.storage)
    if latest is None or not _trained_to_limits(latest[1], job):
        return None
    uri, metrics = latest
    epochs = int(metrics["epoch"]) + (1 if metrics.get("kind") == "epoch" else 0)
    t = job.trainer
    print(
        f"raytrain: run {job.name} is complete: its latest checkpoint {uri} is at epoch "
        f"{epochs}, step {int(metrics['step'])} (trainer.max_epochs={t.max_epochs}, "
        f"trainer.max_steps={t.max_steps}); nothing was trained or logged. To train further, "
        "raise trainer.max_epochs or trainer.max_steps; to start over, pass --fresh",
        file=sys.stderr,
    )
    shown = {k: v for k, v in metrics.items() if k not in (SCORE_KEY, "kind")}
    return FitResult(
        name=job.name,
        metrics=shown,
        best_checkpoint_uri=None,
        latest_checkpoint_uri=uri,
        mlflow_run_id=state.mlflow_run_id,
        tracking_uri=redact(state.tracking_uri) if state.tracking_uri else None,
        run_dir=runstate.run_dir(job),
        wall_time_s=time.time() - start,
        already_complete=True,
    )


def _drop_uncommitted(spec: JobSpec, held: Lease) -> None:
    """Delete checkpoint folders that are provably partial uploads (see ``uncommitted``),
    and say which uncommitted ones stay and why. Nothing is deleted when the lease was
    taken with --force from a live run: that run may still be uploading."""
    left = uncommitted(runstate.run_dir(spec), spec.storage)
    if held.displaced is not None and left.partial:
        print(
            f"raytrain: kept {len(left.partial)} uncommitted checkpoint folder(s): the run "
            "this one displaced with --force may still be uploading them",
            file=sys.stderr,
        )
        return
    for uri in left.partial:
        storage.delete_dir(uri, spec.storage)
        print(f"raytrain: removed {uri}: its upload never completed", file=sys.stderr)
    if left.kept:
        print(
            f"raytrain: kept {len(left.kept)} checkpoint folder(s) Ray Train's snapshot does "
            f"not list ({left.why}): {', '.join(left.kept)}",
            file=sys.stderr,
        )


def _resume_point(spec: JobSpec, held: Lease) -> str | None:
    """Say which checkpoint the run resumes from, if any; returns its URI. Uploads that
    never completed are removed first: a run resumes only from a committed checkpoint."""
    _drop_uncommitted(spec, held)
    latest = latest_committed(runstate.run_dir(spec), spec.storage)
    if latest is None:
        return None
    uri, metrics = latest
    print(
        f"raytrain: resuming {spec.name} from {uri} "
        f"(epoch {int(metrics.get('epoch', 0)) + 1}, step {metrics.get('step', '?')})",
        file=sys.stderr,
    )
    return uri


def _checkpoint_uri(spec: JobSpec, checkpoint: Any) -> str | None:
    if checkpoint is None:
        return None
    return storage.join(runstate.run_dir(spec), os.path.basename(checkpoint.path.rstrip("/")))


def fit(
    spec: str | os.PathLike[str] | Mapping[str, Any] | JobSpec,
    overrides: Iterable[str] = (),
    *,
    fresh: bool = False,
    resume_anyway: bool = False,
    force: bool = False,
    progress: bool | TextIO = True,
    verbose: bool = False,
) -> FitResult:
    """Train the job ``spec`` describes and return its result.

    ``spec`` is a YAML path, a mapping or a ``JobSpec``; ``overrides`` are ``a.b=value``
    strings. A run with the same ``name`` and ``checkpoint.storage`` as an earlier one resumes
    it from its latest checkpoint and continues its MLflow run; ``fresh`` starts it over.
    """
    start = time.time()
    timings: dict[str, float] = {}

    def mark(phase: str) -> None:
        timings[phase] = round(time.time() - start, 3)

    job = _check_before_ray(load_spec(spec, overrides))
    state = _check_resumable(job, fresh, resume_anyway)
    _check_run_folder(job, fresh, force)
    mark("validated")
    done = None if fresh else _already_complete(job, state, start)
    if done is not None:
        return done
    # The driver's own modules (torch with Ray Train) are imported while Ray starts: starting
    # Ray is mostly waiting on its daemons. The model's module (Lightning) is imported here
    # only if its source does not show a LightningModule; the workers import it anyway.
    module, _, name = job.model.class_path.partition(":")
    import_model = not source_check.is_lightning_module(module, name)
    model_check = Background(lambda: _check_model_and_import(job, import_model))
    ray_handle = ray_runtime.connect(job, verbose=verbose)
    mark("ray_ready")
    record = held = None
    try:
        preflight.raise_if(model_check.result())
        mark("model_checked")
        held = Lease(runstate.run_dir(job), job.storage).acquire(force=force)
        held.start_heartbeat()
        _prepare_data(job)
        record = RunRecord(job, _open_run(job, state, fresh, held))
        resumed_from = record.resumed_from = _resume_point(job, held)
        result, last, data_paths = _train(job, ray_handle, record, held, progress, mark)
        if record.opened_at is not None:
            timings["tracking_ready"] = round(record.opened_at - start, 3)
        for key, phase in _WORKER_PHASES.items():
            if key in last:
                timings[phase] = round(last.pop(key) - start, 3)
    except BaseException as exc:
        if record is not None:
            killed = isinstance(exc, KeyboardInterrupt)
            record.finish("KILLED" if killed else "FAILED", error=str(exc))
        if held is not None:
            held.release()
        raise
    finally:
        ray_handle.shutdown()
        mark("ray_stopped")

    try:
        _drop_uncommitted(job, held)  # left by attempts that failed during this run
        metrics = _final_metrics(result, last, job)
        best = _best_checkpoint(job, result)
        model_uri = record.log_model(best)
        mark("model_logged")
        record.finish("FINISHED", best=best or "")
        record.raise_if_unregistered()  # register_as asked for, model missing: exit 1
    finally:
        held.release()
    return FitResult(
        name=job.name,
        metrics=metrics,
        best_checkpoint_uri=best,
        latest_checkpoint_uri=_checkpoint_uri(job, result.checkpoint),
        mlflow_run_id=record.state.mlflow_run_id,
        tracking_uri=redact(record.tracking_uri),  # no user info: results get printed
        run_dir=runstate.run_dir(job),
        resumed_from=resumed_from,
        wall_time_s=time.time() - start,
        timings=timings,
        data_paths=data_paths,
        checkpoints=[_checkpoint_uri(job, c) for c, _ in result.best_checkpoints or []],
        model_uri=model_uri,
    )


# Wall-clock times rank 0 reports once (see report_callback), as startup phases.
_WORKER_PHASES = {
    "_worker_started_at": "worker_started",
    "_loop_entered_at": "train_loop_entered",
    "_lightning_imported_at": "lightning_imported",
    "_fit_started_at": "fit_started",
    "_first_step_at": "first_step",
}


def _check_model_and_import(job: JobSpec, import_model: bool) -> list[str]:
    """Import and check the model class if asked, then the modules ``_train`` needs first
    (MLflow's are imported later, beside the workers' start, by ``RunRecord``)."""
    problems = preflight.check_model(job) if import_model else []
    if not problems:
        import ray.train.torch  # noqa: F401

        import raytrain.worker  # noqa: F401
    return problems


def _train(
    job: JobSpec,
    ray_handle: Any,
    record: RunRecord,
    held: Lease,
    progress: bool | TextIO,
    mark: Any,
):
    """Build the datasets and the trainer, open the run's records while the workers start,
    and train. Returns (Ray's result, the newest value of every metric rank 0 reported, how
    each split reached the workers)."""
    from ray.train import (
        CheckpointConfig,
        FailureConfig,
        RunConfig,
        ScalingConfig,
        TrainingFailedError,
    )
    from ray.train.torch import TorchConfig

    from raytrain.data import build_datasets, dataset_config
    from raytrain.progress import ProgressLine, ReportPump, start_sink
    from raytrain.ray_trainer import RaytrainTorchTrainer, RunAborted
    from raytrain.worker import train_loop

    datasets, cached = build_datasets(job, ray_handle.object_store_bytes())
    mark("datasets_ready")
    sink = start_sink()
    ckpt = job.checkpoint
    storage_fs, storage_path = storage.filesystem(ckpt.storage, job.storage)
    run_config = RunConfig(
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
    trainer = RaytrainTorchTrainer(
        embedded_env=ray_handle.embedded_env,
        train_loop_per_worker=train_loop,
        train_loop_config={"spec": job.model_dump(mode="json"), "sink": sink, "cached": cached},
        torch_config=TorchConfig(backend="nccl" if job.scaling.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=job.scaling.num_workers,
            elastic_resize_monitor_interval_s=job.scaling.resize_check_s,
            use_gpu=job.scaling.use_gpu,
            resources_per_worker=job.scaling.worker_resources(),
        ),
        run_config=run_config,
        datasets=datasets,
        dataset_config=dataset_config(),
    )
    # A run that cannot be recorded does not train: opening the records aborts it; so does
    # another run taking the lease over.
    record.start(on_error=lambda exc: trainer.abort())
    held.on_lost = lambda holder: trainer.abort()
    handlers = [record.log_metrics]
    line = None
    if progress:
        stream = progress if not isinstance(progress, bool) else sys.stderr
        line = ProgressLine(job.trainer.max_epochs, job.trainer.max_steps, stream=stream)
        handlers.append(line)
    try:
        with ReportPump(sink, handlers) as pump:
            result = trainer.fit()
            mark("trained")
    except RunAborted:
        if held.lost_to is not None:
            raise RunStateError(
                f"name: {held.path} was taken over by another run "
                f"({held.lost_to.describe(time.time())}); this run stopped"
            ) from None
        record.tracker()  # raises why the run was aborted
        raise
    except TrainingFailedError as exc:
        raise TrainingFailed(_worker_errors(exc)) from exc
    finally:
        if line is not None:
            line.close()
    record.tracker()
    if result.error is not None:
        raise TrainingFailed(_worker_errors(result.error))
    if pump.errors:  # training finished; say what the progress line or MLflow missed
        print(
            f"raytrain: warning: {len(pump.errors)} metric report(s) were not recorded; "
            f"first: {type(pump.errors[0]).__name__}: {pump.errors[0]}",
            file=sys.stderr,
        )
    data_paths = {**{k: "streamed" for k in datasets}, **{k: "cached" for k in cached}}
    return result, pump.latest, data_paths


def _worker_errors(exc: BaseException) -> list[str]:
    """The workers' own exceptions, not only Ray's wrapper around them."""
    failures = getattr(exc, "worker_failures", None)
    if failures:
        return [f"training failed on rank {rank}: {_root(err)}" for rank, err in failures.items()]
    return [f"training failed: {_root(exc)}"]


def _root(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc.__cause__
    while cause is not None and cause is not exc:
        exc, cause = cause, getattr(cause, "cause", None) or cause.__cause__
    return f"{type(exc).__name__}: {exc}".strip()


def _final_metrics(result: Any, latest: dict[str, Any] | None, job: JobSpec) -> dict[str, Any]:
    """The newest value of every metric reported; a run that trained nothing more (already
    at max_epochs) reports its latest checkpoint's."""
    metrics = dict(latest or {})
    if not metrics:
        committed = latest_committed(runstate.run_dir(job), job.storage)
        metrics = dict(committed[1]) if committed else dict(result.metrics or {})
    for key in (SCORE_KEY, "kind", MONITOR_MISSING):
        metrics.pop(key, None)
    return metrics


def _best_checkpoint(job: JobSpec, result: Any) -> str | None:
    entries = result.best_checkpoints or []
    if not entries:
        return _checkpoint_uri(job, result.checkpoint)
    return _checkpoint_uri(job, best_of(entries, job.checkpoint.monitor, job.checkpoint.mode))


def best_of(entries: list[tuple[Any, dict[str, Any]]], monitor: str | None, mode: str) -> Any:
    """The best of Ray Train's kept checkpoints, (checkpoint, metrics) pairs as Ray keeps
    them (by score, worst first, equal scores in the order reported; with no monitor, in
    the order reported): the best finite score, the newest of equals; with no monitor, or
    no checkpoint scored (the monitored metric was never reported), the newest."""
    sign = 1 if mode == "max" else -1
    best, best_score = entries[-1][0], None
    if not monitor:
        return best
    for checkpoint, metrics in entries:
        score = metrics.get(SCORE_KEY)
        if not isinstance(score, int | float) or not math.isfinite(score):
            continue
        if best_score is None or sign * score >= sign * best_score:
            best, best_score = checkpoint, score
    return best
