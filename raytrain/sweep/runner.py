"""``raytrain tune``: a sweep on Ray Tune, every trial a whole raytrain run.

The driver checks the spec once for the whole sweep (``launcher.check_before_ray`` on the
spec without ``tune``, and every bound of the search space against the spec's validation),
starts or joins Ray, and opens the sweep's parent MLflow run. Ray Tune then runs the trials
(``sweep.trial``), as many at once as the cluster holds; ASHA stops the poorer ones at its
rungs, which ends their trial actors and with them their Ray Train workers. When Tune is
done the driver closes each unfinished trial's MLflow run with the reason, writes the best
trial's spec as a plain spec (``best.yaml``), and records the best trial and a plot of the
metric against each sampled field on the parent run.

Where things are: ``{checkpoint.storage}/{name}/`` is the sweep's folder: ``trials/`` the
trials' run folders (``{name}-000``, ...), ``tune/`` Ray Tune's experiment state,
``raytrain-sweep.json`` the parent run's id (the record that makes the folder a sweep's:
a run's folder is refused, and only a sweep's is deleted by ``--fresh``),
``raytrain-lease.json`` the lease the driver holds while it runs (``driver.lease``, as a
run's), ``best.yaml`` the best spec. The same command again continues an interrupted sweep:
Tune restores its experiment, finished trials are not rerun, and a trial that was running
resumes from its last committed checkpoint (its run folder), or returns at once when it had
reached its end.

What a sweep writes and prints holds no credential: its params, tags, artifacts, rows,
lines and ``best.yaml`` pass through ``raytrain.util.redaction``; Ray Tune gets listed values as
indices (``space.param_space``), names each trial's folder by the trial's name, and runs
without its per-trial loggers, so no sampled value reaches Tune's files.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from raytrain import storage
from raytrain.driver import preflight, ray_runtime
from raytrain.errors import RunStateError, SpecError
from raytrain.records import run_folder
from raytrain.records.lease import Lease, check_free
from raytrain.spec import JobSpec, load_spec
from raytrain.spec.tune import TuneSpec
from raytrain.sweep.results import SweepResult, TrialRow, best_of
from raytrain.sweep.space import (
    base_tree,
    check_space,
    listed_values,
    param_space,
    trial_spec,
    values_of,
)
from raytrain.sweep.trial import (
    BEST_CHECKPOINT,
    MLFLOW_RUN,
    TRIAL_NAME,
    TrialPlan,
    run_trial,
    trial_name,
    trial_values,
    tune_trial_name,
)
from raytrain.util.redaction import masked_fields, redact, redact_value

if TYPE_CHECKING:
    from ray.train import Result
    from ray.tune import ResultGrid, Tuner
    from ray.tune.schedulers import TrialScheduler
    from ray.tune.search import SearchAlgorithm, Searcher

    from raytrain.tracking.mlflow_tracker import MlflowTracker

SWEEP_FILE = run_folder.SWEEP_RECORD
# Ray Tune's settings while it runs the sweep: its own tables and banners off (its legacy
# reporter at verbose 0 prints nothing; the sweep prints a line per trial and its summary),
# and its per-trial loggers off (result.json, params.json and .pkl, progress.csv, TensorBoard
# events: MLflow is the sweep's record, and each is one more file a value could land in).
_TUNE_ENV = {"RAY_AIR_NEW_OUTPUT": "0", "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1"}
BEST_SPEC = "best.yaml"
TRIALS = "trials"
TUNE_DIR = "tune"
# What Ray Tune adds to every result; the rest is what the trial reported.
_TUNE_KEYS = {
    "timestamp",
    "checkpoint_dir_name",
    "done",
    "training_iteration",
    "trial_id",
    "date",
    "time_this_iter_s",
    "time_total_s",
    "pid",
    "hostname",
    "node_ip",
    "config",
    "time_since_restore",
    "iterations_since_restore",
    TRIAL_NAME,
    BEST_CHECKPOINT,
    MLFLOW_RUN,
}


def sweep_dir(job: JobSpec) -> str:
    """The sweep's folder: ``{checkpoint.storage}/{name}``."""
    return storage.join(storage.resolve(job.checkpoint.storage), job.name)


def tune(
    spec: str | os.PathLike[str] | Mapping[str, Any] | JobSpec,
    overrides: Iterable[str] = (),
    *,
    fresh: bool = False,
    force: bool = False,
    progress: bool = True,
    verbose: bool = False,
) -> SweepResult:
    """Run the sweep the spec's ``tune`` section describes (see the module docstring).
    Everything is checked before anything is written; the sweep's folder is held by a
    lease (``driver.lease``, as a run's) from then to the end: a second live sweep of the
    name is refused (``force`` takes it over), and one that takes this sweep's over stops
    it. ``fresh`` deletes the folder first when it holds this sweep's record."""
    start = time.time()
    job, base_job = _checked(spec, overrides)
    folder = sweep_dir(job)
    owned = run_folder.check_kind(folder, job.storage, "sweep")
    check_free(folder, job.storage, force=force, kind="sweep")
    state = None if fresh else _load_state(folder, job)
    timings = {"validated": round(time.time() - start, 3)}
    held = Lease(folder, job.storage, kind="sweep").acquire(force=force)
    try:
        if fresh and owned:
            run_folder.delete_own(folder, job.storage, "sweep", held)
        from raytrain.sweep.tune_callbacks import LOST_LEASES

        held.on_lost = lambda holder: LOST_LEASES.add(folder)
        held.start_heartbeat()
        result = _sweep(job, base_job, folder, state, held, progress, (start, timings))
    finally:
        held.release()
    result.timings = {**timings, "total": round(time.time() - start, 3)}
    return result


def _checked(
    spec: str | os.PathLike[str] | Mapping[str, Any] | JobSpec, overrides: Iterable[str]
) -> tuple[JobSpec, JobSpec]:
    """The sweep's spec and its trials' base spec, every check made that needs no Ray."""
    from raytrain.driver.launcher import check_before_ray

    job = load_spec(spec, overrides)
    if job.tune is None:
        raise SpecError(
            "tune: missing: a sweep needs a tune section (search_space, metric, "
            "mode); `raytrain run` trains a spec without one"
        )
    base_job = check_before_ray(job.model_copy(update={"tune": None}))
    preflight.raise_if(check_space(job) + _search_alg_problems(job.tune))
    return job, base_job


def _sweep(
    job: JobSpec,
    base_job: JobSpec,
    folder: str,
    state: dict[str, Any] | None,
    held: Lease,
    progress: bool,
    clock: tuple[float, dict[str, float]],
) -> SweepResult:
    """Ray started or joined, the parent MLflow run opened, Tune's trials run, the sweep
    recorded; the parent run ends FAILED (KILLED on Ctrl-C) when anything fails."""
    from raytrain.driver.launcher import prepare_data

    assert job.tune is not None
    sweep, (start, timings) = job.tune, clock
    ray_handle = _start_ray(base_job, sweep)
    parent = None
    try:
        prepare_data(base_job)  # once, here: trials running side by side would race on it
        concurrency = _concurrency(base_job, sweep, ray_handle.resources())
        parent, tracking_uri, experiment = _open_parent(base_job, sweep, state)
        write_record(folder, job, parent.run_id)
        plan = _plan(job, base_job, folder, parent.run_id, tracking_uri, experiment, ray_handle)
        print(
            f"raytrain: sweep {job.name}: {sweep.num_samples} sample(s), up to "
            f"{concurrency} trial(s) at once, in {redact(folder)}",
            file=sys.stderr,
        )
        with _tune_output_off():
            grid = _tuner(job, sweep, plan, folder, concurrency, progress).fit()
        timings["trials_done"] = round(time.time() - start, 3)
        rows, values = _rows(grid, plan)
        _close_trials(rows, tracking_uri, sweep)
        _raise_if_stopped(grid, held)
        return _finish(job, base_job, plan, rows, values, parent, folder)
    except BaseException as exc:
        if parent is not None:
            with contextlib.suppress(Exception):  # the sweep's own error is the one to raise
                parent.finish(
                    "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED",
                    error=str(exc) or type(exc).__name__,
                )
        raise
    finally:
        ray_handle.shutdown()


def _plan(
    job: JobSpec,
    base_job: JobSpec,
    folder: str,
    parent_run_id: str,
    tracking_uri: str,
    experiment: str,
    ray_handle: ray_runtime.RayHandle,
) -> TrialPlan:
    """What every trial gets (``TrialPlan``)."""
    from raytrain.tracking.mlflow_tracker import attempt_tags

    assert job.tune is not None
    return TrialPlan(
        base=base_tree(base_job),
        sweep=job.name,
        trials_storage=storage.join(folder, TRIALS),
        tracking_uri=tracking_uri,
        experiment=experiment,
        parent_run_id=parent_run_id,
        metric=job.tune.metric,
        mode=job.tune.mode,
        time_attr=job.tune.scheduler.time_attr,
        cwd=os.getcwd(),
        tags=attempt_tags(),  # a submitted sweep's job id: its trials' actors lack it
        embedded_env=ray_handle.embedded_env,
        listed=listed_values(job.tune),
    )


def _raise_if_stopped(grid: ResultGrid, held: Lease) -> None:
    """The sweep's end when Tune stopped it: a trial's missing metric (exit 2), or another
    sweep that took its folder's lease over."""
    metric_error = _metric_error(grid)
    if metric_error is not None:
        raise SpecError(metric_error)
    if held.lost_to is not None:
        raise RunStateError(
            f"name: {held.path} was taken over by another sweep "
            f"({held.lost_to.describe(time.time())}); this sweep "
            "stopped"
        )


@contextlib.contextmanager
def _tune_output_off() -> Iterator[None]:
    """``_TUNE_ENV`` set while Tune runs, what was there before restored after."""
    before = {name: os.environ.get(name) for name in _TUNE_ENV}
    os.environ.update(_TUNE_ENV)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _search_alg_problems(sweep: TuneSpec) -> list[str]:
    import importlib.util

    if sweep.search_alg == "optuna" and importlib.util.find_spec("optuna") is None:
        return ["tune.search_alg: optuna is not installed: pip install 'raytrain[optuna]'"]
    return []


def _digest(job: JobSpec) -> str:
    """What identifies the sweep: the spec with its search, without what a resume may
    change (as a run's digest)."""
    assert job.tune is not None
    text = json.dumps(
        [job.model_copy(update={"tune": None}).digest(), job.tune.model_dump(mode="json")],
        sort_keys=True,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_record(folder: str, job: JobSpec, parent_run_id: str) -> None:
    """The sweep's record, ``raytrain-sweep.json``: its name, its digest (``_digest``) and
    its parent MLflow run. It makes the folder provably a sweep's (``run_folder.RECORDS``)."""
    state = {"name": job.name, "digest": _digest(job), "parent_run_id": parent_run_id}
    storage.write_text(storage.join(folder, SWEEP_FILE), json.dumps(state), job.storage)


def _load_state(folder: str, job: JobSpec) -> dict[str, Any] | None:
    """The sweep's record, when this sweep ran before; a different spec is refused."""
    path = storage.join(folder, SWEEP_FILE)
    text = storage.read_text(path, job.storage)
    if text is None:
        return None
    try:
        state = json.loads(text)
        if not isinstance(state, dict) or not isinstance(state.get("parent_run_id"), str):
            raise ValueError("not a sweep record")
    except ValueError as exc:
        raise SpecError(
            f"{path}: the sweep's record cannot be read ({exc}); pass --fresh to "
            "start the sweep over"
        ) from None
    if state.get("digest") != _digest(job):
        raise SpecError(
            f"name: sweep {job.name!r} in {folder} was started with a different "
            "spec or search; pass --fresh to start it over, or choose another "
            "name"
        )
    return state


def _start_ray(base_job: JobSpec, sweep: TuneSpec) -> ray_runtime.RayHandle:
    """Join the cluster, or start one here with room for as many trials as this machine's
    cores hold (``$RAYTRAIN_LOCAL_CPUS`` decides instead), plus Ray Data's CPUs."""
    import ray

    if ray.is_initialized() or ray_runtime.joins_cluster():
        return ray_runtime.connect(base_job)
    per_trial = ray_runtime.workers_cpus(base_job)
    trials = max(1, (os.cpu_count() or 1) // per_trial)
    if sweep.max_concurrent_trials is not None:
        trials = min(trials, sweep.max_concurrent_trials)
    requested = os.environ.get(ray_runtime.LOCAL_CPUS_ENV)
    cpus = int(requested) if requested else trials * per_trial + ray_runtime.DATA_CPUS
    return ray_runtime.start_local(cpus)


def _concurrency(base_job: JobSpec, sweep: TuneSpec, resources: dict[str, float]) -> int:
    """How many trials run at once: as many as the cluster's CPUs (and GPUs) hold beside
    Ray Data's, at most ``max_concurrent_trials``."""
    per_worker = base_job.scaling.worker_resources()
    workers = base_job.scaling.max_workers
    fits = []
    for resource, amount in per_worker.items():
        if amount > 0:
            have = resources.get(resource, 0.0)
            if resource == "CPU":
                have -= ray_runtime.DATA_CPUS
            fits.append(int(have // (amount * workers)))
    trials = max(1, min(fits) if fits else 1)
    return min(trials, sweep.max_concurrent_trials or trials)


def _open_parent(
    base_job: JobSpec, sweep: TuneSpec, state: dict[str, Any] | None
) -> tuple[MlflowTracker, str, str]:
    """The sweep's parent MLflow run (reopened on a resume): (tracker, URI, experiment)."""
    from raytrain.driver.run_record import tracking_error
    from raytrain.tracking.mlflow_tracker import MlflowTracker, default_tracking_uri

    tracking_uri = base_job.tracking.mlflow.tracking_uri or default_tracking_uri()
    experiment = base_job.tracking.mlflow.experiment or base_job.name
    try:
        parent, _ = MlflowTracker.open(
            base_job, tracking_uri, state["parent_run_id"] if state else None
        )
        parent.set_tags({"raytrain.sweep": base_job.name, "raytrain.sweep.role": "parent"})
        space = {
            f"tune.search_space.{k}": f"{d.kind} {redact_value(k, getattr(d, d.kind))}"
            for k, d in sweep.search_space.items()
        }
        settings = sweep.model_dump(mode="json", exclude={"search_space"})
        parent.log_params({**space, **{f"tune.{k}": v for k, v in _flat(settings).items()}})
    except Exception as exc:
        raise tracking_error(tracking_uri, exc) from exc
    return parent, tracking_uri, experiment


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _tuner(
    job: JobSpec, sweep: TuneSpec, plan: TrialPlan, folder: str, concurrency: int, progress: bool
) -> Tuner:
    """Ray Tune's ``Tuner`` for the sweep, restored from its folder when it ran before."""
    from ray import tune

    # A trial's actor only drives its run (Ray Train's workers reserve their own); Tune
    # refuses an empty reservation, so it holds a sliver of a CPU.
    trainable = tune.with_resources(tune.with_parameters(run_trial, plan=plan), {"cpu": 0.01})
    fs, path = storage.filesystem(folder, job.storage)
    experiment = f"{path.rstrip('/')}/{TUNE_DIR}"
    from raytrain.sweep.tune_callbacks import MetricGate, TrialLines

    gate = MetricGate(folder)
    lines = TrialLines(plan.sweep, sweep.metric, _shown(plan.listed))
    callbacks = [gate, *([lines] if progress else [])]
    run_config = tune.RunConfig(
        name=TUNE_DIR,
        storage_path=path,
        storage_filesystem=fs,
        stop=gate,
        callbacks=callbacks,
        verbose=0,
        failure_config=tune.FailureConfig(max_failures=0),
    )
    if tune.Tuner.can_restore(experiment, storage_filesystem=fs):
        print(f"raytrain: sweep {job.name}: continuing from {folder}", file=sys.stderr)
        return tune.Tuner.restore(
            experiment,
            trainable,
            resume_unfinished=True,
            resume_errored=True,
            storage_filesystem=fs,
        )
    return tune.Tuner(
        trainable,
        param_space=param_space(sweep),
        tune_config=tune.TuneConfig(
            metric=sweep.metric,
            mode=sweep.mode,
            num_samples=sweep.num_samples,
            # random search bounds it in its generator; Tune bounds a Searcher's (Optuna's)
            max_concurrent_trials=concurrency if sweep.search_alg != "random" else None,
            scheduler=_scheduler(job, sweep),
            search_alg=search_alg(sweep, concurrency),
            # short names: Tune's default puts the sampled values into each trial's folder
            trial_name_creator=functools.partial(tune_trial_name, plan.sweep),
            trial_dirname_creator=functools.partial(tune_trial_name, plan.sweep),
        ),
        run_config=run_config,
    )


def _shown(listed: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The listed values as the trial lines show them: redacted (Tune keeps its callbacks
    with its experiment, so they hold nothing else)."""
    return {key: [redact_value(key, v) for v in values] for key, values in listed.items()}


def _scheduler(job: JobSpec, sweep: TuneSpec) -> TrialScheduler:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    chosen = sweep.scheduler
    if chosen.name == "fifo":
        return FIFOScheduler()
    limit = job.trainer.max_epochs if chosen.time_attr == "epoch" else job.trainer.max_steps
    max_t = chosen.resolved_max_t(limit)  # checked against grace_period: space.schedule_problems
    return ASHAScheduler(
        time_attr=chosen.time_attr,
        max_t=max_t,
        grace_period=chosen.grace_period,
        reduction_factor=chosen.reduction_factor,
    )


def search_alg(sweep: TuneSpec, concurrency: int) -> Searcher | SearchAlgorithm:
    """Tune's searcher for ``tune.search_alg``: Optuna's TPE, or random (grid for `grid`
    fields) from a generator seeded with ``tune.seed``."""
    if sweep.search_alg == "optuna":
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(seed=sweep.seed)
    from ray.tune.search.basic_variant import BasicVariantGenerator

    return BasicVariantGenerator(random_state=sweep.seed, max_concurrent=concurrency)


def _metric_error(grid: Any) -> str | None:
    from raytrain.sweep.tune_callbacks import metric_error

    return next((e for r in grid if (e := metric_error(r.error)) is not None), None)


def _rows(grid: Any, plan: TrialPlan) -> tuple[list[TrialRow], dict[str, dict[str, Any]]]:
    """A row per trial, its values as they may be shown and written (``redaction``), and
    each trial's values as they are, by trial name (the best one's make ``best.yaml``)."""
    rows, values = [], {}
    for result in grid:
        row = _row(result, plan)
        rows.append(row)
        values[row.name] = values_of(dict(result.config or {}), plan.listed)
    return rows, values


def _row(result: Result, plan: TrialPlan) -> TrialRow:
    """A trial's row from its Tune result (its values redacted), and its MLflow run from
    its run folder."""
    from raytrain.records import runstate

    metrics = dict(result.metrics or {})
    config = dict(result.config or {})
    name = metrics.get(TRIAL_NAME) or trial_name(plan.sweep, str(metrics.get("trial_id", "0")))
    run_id = metrics.get(MLFLOW_RUN) or None
    if run_id is None:
        try:
            spec = trial_spec(plan.base, trial_values(plan, config, name), name)
            state = runstate.load(spec)
            run_id = state.mlflow_run_id if state else None
        except Exception:
            run_id = None
    if result.error is not None:
        status = "error"
    elif metrics.get(TRIAL_NAME):
        status = "finished"
    else:
        status = "stopped"
    reported = {k: v for k, v in metrics.items() if k not in _TUNE_KEYS}
    values = {k: redact_value(k, v) for k, v in values_of(config, plan.listed).items()}
    return TrialRow(
        name=name,
        status=status,
        values=values,
        metrics=reported,
        epochs=int(metrics.get("epoch", 0) or 0),
        mlflow_run_id=run_id,
        error=None if result.error is None else redact(str(result.error).splitlines()[0][:500]),
        checkpoint=metrics.get(BEST_CHECKPOINT) or None,
    )


def _close_trials(rows: list[TrialRow], tracking_uri: str, sweep: TuneSpec) -> None:
    """End the MLflow run of each trial that did not finish, once Tune has ended them all:
    a trial the scheduler stopped FINISHED, with the reason in ``raytrain.stopped``; one
    that failed FAILED, with its error. The driver alone closes these (a trial leaves its
    run open when it fails, ``run_job(close_on_failure=False)``): a stopped trial's actor
    can fail while it ends, and a status it wrote after this one would win."""
    from raytrain.tracking.mlflow_tracker import MlflowTracker

    for row in rows:
        if row.status == "finished" or row.mlflow_run_id is None:
            continue
        tracker = MlflowTracker.attach(tracking_uri, row.mlflow_run_id)
        if row.status == "error":
            tracker.finish("FAILED", error=row.error or "the trial failed")
            continue
        score = row.score(sweep.metric)
        shown = f"{sweep.metric} {score:.4g}" if score is not None else f"no {sweep.metric}"
        tracker.set_tags(
            {
                "raytrain.stopped": f"{sweep.scheduler.name}: stopped after "
                f"{row.epochs} epoch(s) ({shown}, behind the trials at its "
                "rung)"
            }
        )
        tracker.finish("FINISHED")


def _finish(
    job: JobSpec,
    base_job: JobSpec,
    plan: TrialPlan,
    rows: list[TrialRow],
    values: dict[str, dict[str, Any]],
    parent: MlflowTracker,
    folder: str,
) -> SweepResult:
    """The best trial's spec written out, the parent run's record of the sweep. Everything
    written or returned holds redacted values (``rows``); only ``best.yaml``'s spec is made
    from the best trial's own ``values``, and written redacted."""
    assert job.tune is not None
    sweep = job.tune
    best = best_of(rows, sweep.metric, sweep.mode)
    best_path = best_checkpoint = None
    if best is not None:
        best_spec = trial_spec(base_tree(base_job), values[best.name], f"{job.name}-best")
        best_path = storage.join(folder, BEST_SPEC)
        storage.write_text(best_path, best_spec_yaml(best_spec), job.storage)
        parent.log_metrics({f"best.{k}": v for k, v in best.metrics.items()}, step=0)
        sampled = {f"raytrain.best.{k}": str(v) for k, v in best.values.items()}
        parent.set_tags(
            {
                "raytrain.best_trial": best.name,
                "raytrain.best_run_id": best.mlflow_run_id or "",
                **sampled,
            }
        )
    _log_trials(parent, rows, sweep.metric, sweep.mode)
    if best is not None:
        best_checkpoint = _best_checkpoint(plan, best)
    parent.finish("FINISHED")
    return SweepResult(
        name=job.name,
        metric=sweep.metric,
        mode=sweep.mode,
        best=best,
        best_spec_path=best_path,
        best_checkpoint_uri=best_checkpoint,
        trials=rows,
        mlflow_run_id=parent.run_id,
        tracking_uri=redact(plan.tracking_uri),
        sweep_dir=folder,
    )


def _log_trials(parent: MlflowTracker, rows: list[TrialRow], metric: str, mode: str) -> None:
    """The sweep's plot and every trial's row (``trials.json``), under ``sweep/`` of the
    parent run."""
    from raytrain.sweep.plot import plot_sweep

    with tempfile.TemporaryDirectory(prefix="raytrain-sweep-") as local:
        plot_sweep(rows, metric, mode, os.path.join(local, "sweep.png"))
        table = [
            {
                "trial": r.name,
                "status": r.status,
                "epochs": r.epochs,
                metric: r.score(metric),
                "mlflow_run_id": r.mlflow_run_id,
                **r.values,
            }
            for r in rows
        ]
        with open(os.path.join(local, "trials.json"), "w", encoding="utf-8") as handle:
            json.dump(table, handle, indent=2)
        parent.log_folder(local, "sweep")


def best_spec_yaml(spec: JobSpec) -> str:
    """``best.yaml``: the best trial's spec, its credentials masked as in a run's
    ``spec.yaml`` artifact (``run_record.spec_yaml``), a comment naming the masked fields
    (give them again, as overrides, to run it)."""
    from raytrain.driver.run_record import spec_yaml

    masked = masked_fields(spec.flat())
    head = (
        f"# credentials masked (***): {', '.join(masked)}; give them again to run this "
        "spec (overrides: FIELD=VALUE)\n"
        if masked
        else ""
    )
    return head + spec_yaml(spec)


def _best_checkpoint(plan: TrialPlan, best: TrialRow) -> str | None:
    """The best trial's best checkpoint: its last report says it; else its latest
    committed one."""
    from raytrain.checkpoints.layout import latest_committed

    if best.checkpoint:
        return best.checkpoint
    latest = latest_committed(storage.join(plan.trials_storage, best.name), None)
    return latest[0] if latest else None
