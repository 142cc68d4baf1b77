"""Driver side of a run: spec -> preflight -> Ray -> datasets -> TorchTrainer -> result.

``fit`` is the one entry point: the CLI calls it, pipelines call it. It stops with a
``SpecError`` (exit 2) before Ray starts or anything is written when the spec is bad; it
resumes a run from its latest committed checkpoint when the same name and storage ran before.
The phases live beside it: ``run_folder`` (state, lease, checkpoints), ``training`` (the
trainer and its events), ``results`` (what a run gives back).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any, TextIO

from raytrain import storage
from raytrain._compat.versions import check_supported
from raytrain.contract import RunListener
from raytrain.driver import (
    class_check,
    cluster_record,
    preflight,
    ray_runtime,
    source_check,
    training,
)
from raytrain.driver.background import Background
from raytrain.driver.cluster_watch import lost_line
from raytrain.driver.profiles import log_profiles
from raytrain.driver.results import (
    FitResult,
    Trained,
    best_checkpoint,
    checkpoint_uri,
    final_metrics,
    worker_timings,
)
from raytrain.driver.run_record import RunRecord
from raytrain.errors import ClusterLost, SpecError
from raytrain.records import run_folder, runstate
from raytrain.records.lease import Lease
from raytrain.records.status_record import StatusRecord
from raytrain.spec import JobSpec, load_spec
from raytrain.spec.strategy_checks import strategy_problems
from raytrain.util.imports import import_object
from raytrain.util.precision import bf16_warning
from raytrain.util.redaction import redact

__all__ = ["FitResult", "fit", "validate"]


def validate(
    spec: str | os.PathLike[str] | Mapping[str, Any] | JobSpec, overrides: Iterable[str] = ()
) -> JobSpec:
    """Load and check ``spec`` as ``fit`` would, writing nothing; raises ``SpecError``."""
    job = check_before_ray(load_spec(spec, overrides))
    preflight.raise_if(preflight.check_model(job) + preflight.check_data_functions(job))
    if job.tune is not None:  # every value a trial can get, checked as `raytrain tune` does
        from raytrain.sweep.space import check_space

        preflight.raise_if(check_space(job))
    return job


def check_before_ray(job: JobSpec) -> JobSpec:
    """Every check that needs no import of the model's code (cheap: a spec, file footers,
    the machine); the model's import is checked while Ray starts (``fit``) or after."""
    check_supported()
    up = cluster_record.running()
    if up is not None and not ray_runtime.cluster_address():  # the cluster it will join
        capacity: dict[str, float] | None = {"CPU": up.num_cpus, "GPU": up.num_gpus}
    else:
        capacity = None if ray_runtime.joins_cluster() else preflight.local_capacity(job)
    located = preflight.check_model_located(job)  # a model not found: no parse to add
    preflight.raise_if(
        located
        + ([] if located else class_check.check_classes(job))
        + ([] if located or strategy_problems(job) else preflight.check_pipeline_split(job))
        + preflight.data_functions_located(job)
        + strategy_problems(job)
        + (preflight.check_capacity(job, capacity) if capacity is not None else [])
        + (preflight.check_local_cpus(job) if capacity is not None and up is None else [])
        + preflight.check_stores(job, allow_prepare=True)
    )
    if capacity is not None:  # the workers run on this machine's CPU
        warning = bf16_warning(job.trainer.precision, job.scaling.use_gpu is True)
        if warning:
            print(f"raytrain: warning: {warning}", file=sys.stderr)
    return job


def prepare_data(spec: JobSpec) -> None:
    """Run ``data.prepare`` when the train set is missing, then check what it wrote.

    ``validate`` has already checked data that existed; only freshly written data is new.
    """
    data = spec.files
    if data is None or data.prepare is None:
        return
    train = storage.resolve(data.train_sources()[0][1].uri)
    if not storage.exists(train, spec.storage):
        val = storage.resolve(data.val.uri) if data.val else None
        print(f"raytrain: writing {redact(train)} with {data.prepare}", file=sys.stderr)
        import_object(data.prepare)(train, val)
        preflight.raise_if(preflight.check_data(spec))


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
    job = load_spec(spec, overrides)
    if job.tune is not None:
        raise SpecError(
            "tune: this spec is a sweep: run it with `raytrain tune` (or "
            "raytrain.tune); `raytrain run` trains one spec"
        )
    job = check_before_ray(job)
    return run_job(
        job,
        fresh=fresh,
        resume_anyway=resume_anyway,
        force=force,
        progress=progress,
        verbose=verbose,
        start=start,
    )


def run_job(
    job: JobSpec,
    *,
    fresh: bool = False,
    resume_anyway: bool = False,
    force: bool = False,
    progress: bool | TextIO = True,
    verbose: bool = False,
    listeners: Sequence[RunListener] = (),
    start: float | None = None,
    close_on_failure: bool = True,
    connect: Callable[..., ray_runtime.RayHandle] = ray_runtime.connect,
    train: Callable[..., Trained] = training.train,
) -> FitResult:
    """``fit`` after the checks that need no Ray (``check_before_ray``): a sweep's trial
    runs this, its spec checked once for the whole sweep. ``listeners`` hear the run's
    events (``training.train``). ``close_on_failure`` False leaves a failed run's MLflow
    record open for the caller to close: a sweep's trial, whose failure may be its own
    actor ending after the scheduler stopped it, and whose driver alone knows which.

    What the run opens (Ray, the lease, the MLflow record, the status record) it holds in
    one ``ExitStack``, each closing itself on the way out by how the run ended: the status
    record ``finished`` or ``failed``, the MLflow run ``FAILED`` or ``KILLED``, the lease let
    go, Ray left (``_RaySession``), in that order. ``connect`` and ``train`` are the seam a
    unit test runs the whole of it through without Ray."""
    start = time.time() if start is None else start
    timings: dict[str, float] = {}
    mark = functools.partial(_mark, timings, start)
    state = run_folder.check_resumable(job, fresh, resume_anyway)
    run_folder.check_run_folder(job, fresh, force)
    mark("validated")
    done = None if fresh else run_folder.already_complete(job, state, start)
    if done is not None:
        return done
    model_check = _start_model_check(job)
    with ExitStack() as stack:
        ray = stack.enter_context(_RaySession(connect(job, verbose=verbose), mark))
        mark("ray_ready")
        preflight.raise_if(model_check.result())
        job = _decide_devices(job, ray.handle)
        mark("model_checked")
        held, record, status = _open_records(stack, job, state, fresh, force, close_on_failure)
        trained = train(job, ray.handle, record, held, progress, mark, listeners, status)
        if record.opened_at is not None:
            timings["tracking_ready"] = round(record.opened_at - start, 3)
        timings.update(worker_timings(trained.startup, start))
        ray.stop_soon()  # logging the model and closing the records need no Ray
        result = _finish(job, trained, record, held, mark)
    result.wall_time_s, result.timings = time.time() - start, timings
    return result


def _open_records(
    stack: ExitStack,
    job: JobSpec,
    state: runstate.RunState | None,
    fresh: bool,
    force: bool,
    close_on_failure: bool,
) -> tuple[Lease, RunRecord, StatusRecord]:
    """The run's lease (held, its heartbeat started), its data prepared, its MLflow run
    record and its status record (started), in that order, each entered into ``stack``
    as soon as it is open, so that what opened is closed whatever fails next."""
    held = stack.enter_context(Lease(runstate.run_dir(job), job.storage).acquire(force=force))
    held.start_heartbeat()
    prepare_data(job)
    opened = run_folder.open_run(job, state, fresh, held)
    record = stack.enter_context(RunRecord(job, opened, close_on_failure=close_on_failure))
    record.resumed_from = run_folder.resume_point(job, held)
    attempt, run_id = record.state.attempts + 1, lambda: record.state.mlflow_run_id
    status = stack.enter_context(StatusRecord(job, attempt=attempt, mlflow_run=run_id))
    return held, record, status


def _mark(timings: dict[str, float], start: float, phase: str) -> None:
    """A phase of the run reached: seconds since ``start``, in ``timings``."""
    timings[phase] = round(time.time() - start, 3)


class _RaySession:
    """Ray for one run: left on the way out, at once after a failure, or in the background
    from ``stop_soon`` on, once training is done. A run on the cluster ``raytrain up``
    started that went away raises ``ClusterLost`` (Ray's own error says less)."""

    def __init__(self, handle: ray_runtime.RayHandle, mark: Callable[[str], None]):
        self.handle, self.mark = handle, mark
        self._stopping: Background | None = None

    def __enter__(self) -> _RaySession:
        return self

    def stop_soon(self) -> None:
        """Stop Ray in the background; the environment is put back on this thread on the
        way out (see ``RayHandle``)."""
        self._stopping = Background(lambda: _stop_ray(self.handle, self.mark, restore_env=False))

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if self._stopping is not None:
            try:
                self._stopping.result()
            finally:
                self.handle.restore_env()
            return
        _stop_ray(self.handle, self.mark)
        watch = self.handle.watch
        if exc is not None and watch is not None and self.handle.cluster_lost():
            raise ClusterLost(lost_line(watch.record)) from exc


def _stop_ray(
    ray_handle: ray_runtime.RayHandle, mark: Callable[[str], None], *, restore_env: bool = True
) -> None:
    """Leave Ray (stop it, when this run started it), timed as ``ray_stopped``."""
    ray_handle.shutdown(restore_env=restore_env)
    mark("ray_stopped")


def _decide_devices(job: JobSpec, ray_handle: ray_runtime.RayHandle) -> JobSpec:
    """``scaling.use_gpu: auto`` decided by the cluster's GPUs, said on stderr; the
    strategy's checks again, now that the device is known (FSDP's hybrid needs GPUs)."""
    scaling, said = job.scaling.with_cluster_gpus(ray_handle.resources().get("GPU", 0.0))
    if said is None:
        return job
    print(f"raytrain: {said}", file=sys.stderr)
    job = job.model_copy(update={"scaling": scaling})
    preflight.raise_if(strategy_problems(job))
    return job


def _finish(
    job: JobSpec, trained: Trained, record: RunRecord, held: Lease, mark: Callable[[str], None]
) -> FitResult:
    """After training: drop what failed attempts left, log the model, close the MLflow run
    (the lease is let go on ``run_job``'s way out)."""
    run_folder.drop_uncommitted(job, held)  # left by attempts that failed during this run
    metrics = final_metrics(trained.result, trained.latest, job)
    best = best_checkpoint(job, trained.result)
    model_uri = record.model.log(best)
    mark("model_logged")
    log_profiles(job, record.tracker())
    record.finish("FINISHED", best=best or "")
    mark("tracking_closed")
    # register_as asked for, model missing: exit 1
    record.model.raise_if_unregistered(record.state.mlflow_run_id)
    result = trained.result
    return FitResult(
        name=job.name,
        metrics=metrics,
        best_checkpoint_uri=best,
        latest_checkpoint_uri=checkpoint_uri(job, result.checkpoint),
        mlflow_run_id=record.state.mlflow_run_id,
        tracking_uri=redact(record.tracking_uri),  # no user info: results get printed
        run_dir=runstate.run_dir(job),
        resumed_from=record.resumed_from,
        data_paths=trained.data_paths,
        checkpoints=[u for c, _ in result.best_checkpoints or [] if (u := checkpoint_uri(job, c))],
        model_uri=model_uri,
        stopped=trained.stopped,
        chaos=trained.chaos,
    )


def _start_model_check(job: JobSpec) -> Background:
    """Start, in a thread, the model's check and the imports training needs first.

    The driver's own modules (torch with Ray Train) are imported while Ray starts: starting
    Ray is mostly waiting on its daemons. The model's module (Lightning) is imported only if
    its source does not show a LightningModule; the workers import it anyway."""
    module, _, name = job.model.class_path.partition(":")
    import_model = not source_check.is_lightning_module(module, name)
    return Background(lambda: _check_model_and_import(job, import_model))


def _check_model_and_import(job: JobSpec, import_model: bool) -> list[str]:
    """Import and check the model class if asked, then the modules ``_train`` needs first
    (MLflow's are imported later, beside the workers' start, by ``RunRecord``)."""
    problems = preflight.check_model(job) if import_model else []
    problems += preflight.check_data_functions(job)
    if not problems:
        import ray.train.torch  # noqa: F401

        import raytrain.worker.entry  # noqa: F401
    return problems
