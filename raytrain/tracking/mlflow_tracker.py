"""MLflow tracking: one MLflow run per job, continued across resumes. Driver side only.

The driver records what the workers report (they never talk to MLflow), so a local SQLite
store works on a multi-node cluster and tracking credentials live only on the driver.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from raytrain._compat.mlflow import last_steps
from raytrain.errors import TrackingError, TrackingUnreachable, one_line
from raytrain.spec import JobSpec
from raytrain.util.provenance import git_commit
from raytrain.util.redaction import redact, redact_flat, redact_value

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

_PARAM_BATCH = 100
_PARAM_MAX_CHARS = 6000
_METRIC_BATCH = 1000  # MLflow's most metrics in one log_batch
# What MLflow answers a key (or value) it refuses: a name that is no key, too long...
_REFUSED = "INVALID_PARAMETER_VALUE"
# MLflow prints a link to each run it ends on a tracking server, its host written as the
# tracking URI has it: user info and all.
_NO_LINKS_ENV = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI``, else MLflow's own default: ``mlflow.db`` in this folder.

    That is the store a plain ``mlflow ui`` started in the same folder shows.
    """
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"


def redacted_params(flat: dict[str, Any]) -> dict[str, str]:
    """The flattened spec as params (strings), credentials masked by ``raytrain.util.redaction``:
    a credential-like field keeps its name with its value masked."""
    return {key: str(value) for key, value in redact_flat(flat).items()}


def git_tags() -> dict[str, str]:
    """MLflow's own source tag for the commit (its UI shows it), and whether the working
    tree had uncommitted changes."""
    found = git_commit()
    if found is None:
        return {}
    return {"mlflow.source.git.commit": found[0], "raytrain.git_dirty": str(found[1]).lower()}


def package_versions(packages: tuple[str, ...]) -> dict[str, str | None]:
    """Each package's installed version; None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for package in packages:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def version_tags(spec: JobSpec) -> dict[str, str]:
    """Tags that say what ran: world size, strategy and the versions of the stack."""
    tags = {
        "raytrain.world_size": str(spec.scaling.num_workers)
        if not spec.scaling.elastic
        else f"{spec.scaling.min_workers}-{spec.scaling.max_workers}",
        "raytrain.strategy": spec.strategy.name,
        "raytrain.python": platform.python_version(),
    }
    for package, found in package_versions(("raytrain", "ray", "lightning", "torch")).items():
        tags[f"raytrain.version.{package}"] = found or "unknown"
    return tags


def attempt_tags() -> dict[str, str]:
    """Tags of this attempt at the run: the Ray job it runs as, when it is a submitted job
    (a resumed run records its latest job)."""
    from raytrain.driver.ray_runtime import submission_id

    job = submission_id()
    return {"raytrain.ray_job_id": job} if job else {}


def new_run(client: MlflowClient, spec: JobSpec, tracking_uri: str) -> str:
    """A new MLflow run of ``spec`` in its experiment (made when missing, its artifacts
    beside a local store), tagged with what ran; returns its id."""
    name = spec.tracking.mlflow.experiment or spec.name
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        experiment_id = experiment.experiment_id
    else:
        experiment_id = client.create_experiment(
            name, artifact_location=_artifacts(tracking_uri, name)
        )
    tags = {
        **version_tags(spec),
        **git_tags(),
        **attempt_tags(),
        **{k: redact_value(k, v) for k, v in spec.tracking.mlflow.tags.items()},
        "raytrain.job": spec.name,
    }
    return str(client.create_run(experiment_id, run_name=spec.name, tags=tags).info.run_id)


def metrics_note(
    run_id: str, refused: dict[str, str], recorded_none: bool, finished: bool
) -> str | None:
    """What a run's metrics lost, for its end: the keys MLflow ``refused``, and, loudest,
    a run that recorded no metric at all (``recorded_none``: none now, none in earlier
    attempts), when it had keys refused or ``finished`` (a failed run's error says why it
    has none)."""
    keys = ", ".join(repr(k) for k in list(refused)[:5])
    keys += f" and {len(refused) - 5} more" if len(refused) > 5 else ""
    if recorded_none and (refused or finished):
        why = (
            f"MLflow refused {keys}"
            if refused
            else "no metric was reported (no "
            "training step ran: see trainer.max_steps, max_epochs, the data)"
        )
        return f"MLflow run {run_id} recorded no metrics: {why}"
    return f"MLflow refused {keys}: those metrics are not recorded" if refused else None


class MlflowTracker:
    """One MLflow run, created or reopened by :meth:`open`.

    A metric's history only moves forward: a value at a step no later than the last step
    already logged for that key is dropped. After a restore (a restarted worker group, or a
    rerun after the driver died) the steps between the checkpoint and the failure are
    trained again; MLflow keeps what was logged the first time, so no step is logged twice
    and no curve goes backwards.

    A metric or param MLflow refuses (``INVALID_PARAMETER_VALUE``: a key it does not take)
    is dropped alone: its batch is logged again item by item, the key said on stderr (a
    metric's once: it is never sent again); ``metrics_note`` sums up what the run's metrics
    lost, for its end.
    """

    def __init__(self, client: MlflowClient, run_id: str, tracking_uri: str):
        self.client = client
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self._last_step = last_steps(client, run_id)
        self._had_metrics = bool(self._last_step)  # from earlier attempts
        self.refused: dict[str, str] = {}  # metric key -> MLflow's reason
        self.metrics_logged = 0  # metric values recorded by this tracker
        if redact(tracking_uri) != tracking_uri:  # its links would print the credentials
            os.environ[_NO_LINKS_ENV] = "true"

    @classmethod
    def open(
        cls, spec: JobSpec, tracking_uri: str, run_id: str | None = None
    ) -> tuple[MlflowTracker, bool]:
        """Reopen ``run_id`` when it exists, else start a new run. Returns (tracker, resumed)."""
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri)
        if run_id:
            try:
                client.get_run(run_id)
                client.update_run(run_id, status="RUNNING")
                tracker = cls(client, run_id, tracking_uri)
                tracker.set_tags({**git_tags(), **attempt_tags()})
                return tracker, True
            except MlflowException:
                pass
        return cls(client, new_run(client, spec, tracking_uri), tracking_uri), False

    @classmethod
    def attach(cls, tracking_uri: str, run_id: str) -> MlflowTracker:
        """The existing run ``run_id``, as it is (a sweep's driver closing a trial's run)."""
        from mlflow.tracking import MlflowClient

        return cls(MlflowClient(tracking_uri=tracking_uri), run_id, tracking_uri)

    def log_params(self, params: dict[str, Any]) -> None:
        """Log params not yet on the run, credentials masked (``redaction``, whoever
        logs them); values that changed since are noted in a tag."""
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        fresh, changed = [], {}
        for key, value in params.items():
            text = str(redact_value(key, value))[:_PARAM_MAX_CHARS]
            if key not in existing:
                fresh.append(Param(key, text))
            elif existing[key] != text:
                changed[key] = text
        for start in range(0, len(fresh), _PARAM_BATCH):
            self._log_each("params", fresh[start : start + _PARAM_BATCH])
        if changed:
            attempt = f"raytrain.changed_params.{int(time.time())}"
            self.set_tags({attempt: ", ".join(f"{k}={v}" for k, v in changed.items())})

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(key, float(value), now, step)
            for key, value in metrics.items()
            if isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and not key.startswith("_")
            and key != "step"
            and step > self._last_step.get(key, -1)  # not a replayed step
            and key not in self.refused
        ]
        self._last_step.update((m.key, step) for m in batch)
        for start in range(0, len(batch), _METRIC_BATCH):
            self.metrics_logged += self._log_each("metrics", batch[start : start + _METRIC_BATCH])

    def _log_each(self, kind: str, batch: list[Any]) -> int:
        """Log ``batch`` of ``kind`` (``metrics`` or ``params``) in one call; refused as
        invalid, each of its items alone, so that one key MLflow refuses cannot drop the
        others. Returns how many were recorded. Other errors (an unreachable server) are
        raised as they come."""
        from mlflow.exceptions import MlflowException

        try:
            if kind == "metrics":
                self.client.log_batch(self.run_id, metrics=batch)
            else:
                self.client.log_batch(self.run_id, params=batch)
        except MlflowException as exc:
            if exc.error_code != _REFUSED:
                raise
            if len(batch) > 1:
                return sum(self._log_each(kind, [item]) for item in batch)
            self._refuse(kind, batch[0].key, exc)
            return 0
        return len(batch)

    def _refuse(self, kind: str, key: str, exc: Exception) -> None:
        """Say that MLflow refused ``key``; a metric's is remembered, never sent again."""
        import sys

        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        if kind == "metrics":
            self.refused[key] = reason
        print(
            f"raytrain: warning: MLflow refused the {kind[:-1]} {key!r}, which is not "
            f"recorded (the run's other {kind} are): {reason}",
            file=sys.stderr,
        )

    def metrics_note(self, finished: bool) -> str | None:
        """What the run's metrics lost, for its end (``metrics_note``)."""
        nothing = self.metrics_logged == 0 and not self._had_metrics
        return metrics_note(self.run_id, self.refused, nothing, finished)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_folder(self, local_dir: str, artifact_path: str) -> None:
        """The files of ``local_dir`` as the run's artifacts under ``artifact_path``."""
        self.client.log_artifacts(self.run_id, local_dir, artifact_path)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set ``tags`` on the run, credentials masked (a user's tag, an error's text)."""
        from mlflow.entities import RunTag

        if not tags:
            return
        masked = [RunTag(k, str(redact_value(k, str(v)))) for k, v in tags.items()]
        self.client.log_batch(self.run_id, tags=masked)

    def finish(self, status: str, error: str | None = None) -> None:
        if error:
            self.set_tags({"raytrain.error": error[:5000]})
        self.client.set_terminated(self.run_id, status=status)


def _artifacts(tracking_uri: str, experiment: str) -> str | None:
    """Artifacts of a local SQLite store sit beside the database, not in the working dir."""
    if tracking_uri.startswith("sqlite:///"):
        folder = os.path.join(os.path.dirname(tracking_uri[len("sqlite:///") :]), "mlartifacts")
        return f"file://{os.path.join(folder, experiment)}"
    return None


def local_store_path(tracking_uri: str) -> str | None:
    """The file or folder a local tracking store lives in (``sqlite:///...``, ``file:...``
    or a plain path), or None for a server."""
    from raytrain import storage

    if tracking_uri.startswith("sqlite:///"):
        return os.path.abspath(tracking_uri[len("sqlite:///") :].split("?", 1)[0])
    if storage.is_uri(tracking_uri):  # a server (or a store raytrain does not read)
        return None
    return storage.local_path(tracking_uri)


def _require_store(tracking_uri: str) -> None:
    """A local store that does not exist is a ``TrackingError``: reading it must not create
    it (MLflow would, an empty ``mlflow.db``)."""
    store = local_store_path(tracking_uri)
    if store is not None and not os.path.exists(store):
        raise TrackingError(
            f"--tracking-uri: no MLflow store at {redact(tracking_uri)} ({store} does not "
            "exist); name the store the runs were recorded in (--tracking-uri or "
            "$MLFLOW_TRACKING_URI)"
        )


def _reader(tracking_uri: str) -> MlflowClient:
    """A client of the existing store ``tracking_uri``, for the readers below. A local store
    MLflow cannot open (a file that is no database, a folder) is a ``TrackingError``: MLflow
    opens it here, and raised its own error (or SQLAlchemy's) as a traceback."""
    _require_store(tracking_uri)
    from mlflow.tracking import MlflowClient

    try:
        return MlflowClient(tracking_uri=tracking_uri)
    except Exception as exc:  # MLflow's or SQLAlchemy's: the store, not raytrain, refused
        if local_store_path(tracking_uri) is None:
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise TrackingError(
            f"--tracking-uri: {redact(tracking_uri)} is not an MLflow store MLflow can open "
            f"({one_line(first, 200)})"
        ) from None


# What ``doctor`` and ``report`` (the readers below) give a tracking server: a request with
# no answer in 5 s fails and is tried once more. MLflow's defaults (a 120 s timeout, 7
# retries with backoff) made a server that does not answer cost them minutes. These are
# MLflow's own variables, set only while they read, and only where the user set none: a
# training run's tracker keeps MLflow's patience.
READ_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}


@contextlib.contextmanager
def _reading(tracking_uri: str) -> Iterator[None]:
    """Read ``tracking_uri`` under ``READ_SETTINGS``; a server that cannot be reached is a
    ``TrackingUnreachable`` (exit 1), whatever call met it."""
    from mlflow.exceptions import MlflowException

    added = [name for name in READ_SETTINGS if name not in os.environ]
    os.environ.update({name: READ_SETTINGS[name] for name in added})
    try:
        yield
    except MlflowException as exc:
        _raise_if_unreached(exc, tracking_uri)
        raise
    finally:
        for name in added:
            os.environ.pop(name, None)


def _raise_if_unreached(exc: BaseException, tracking_uri: str) -> None:
    """Raise ``TrackingUnreachable`` when ``exc`` is MLflow's failure to reach a server (a
    connection refused or not made, no answer in time: ``requests``' errors, which MLflow
    wraps); return for anything else (an unknown run, a refusal)."""
    import requests

    error: BaseException | None = exc
    for _ in range(10):  # the chain MLflow leaves: its exception, then requests'
        if error is None or isinstance(error, requests.ConnectionError | requests.Timeout):
            break
        error = error.__cause__ or error.__context__
    if error is None:
        return
    text = str(error)
    if isinstance(error, requests.Timeout) or "timed out" in text:
        why = f"no answer within {os.environ.get('MLFLOW_HTTP_REQUEST_TIMEOUT', '?')} s"
    elif "Connection refused" in text:
        why = "the connection was refused"
    else:
        why = one_line(text, 200)
    raise TrackingUnreachable(
        f"cannot reach the tracking server at {redact(tracking_uri)} "
        f"({why}); is it up, and is this its address?"
    ) from None


def sweep_trials(tracking_uri: str, run_id: str) -> dict[str, Any] | None:
    """When ``run_id`` is a sweep's parent run (``raytrain tune``): its name, metric, mode
    and its trials' run ids; else None."""
    from mlflow.exceptions import MlflowException

    client = _reader(tracking_uri)
    with _reading(tracking_uri):
        try:
            run = client.get_run(run_id)
        except MlflowException as exc:
            _raise_if_unreached(exc, tracking_uri)
            return None  # fetch_runs says it is unknown
        if run.data.tags.get("raytrain.sweep.role") != "parent":
            return None
        children = client.search_runs(
            [run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run_id}'", max_results=10_000
        )
    return {
        "name": run.info.run_name or run_id[:8],
        "metric": run.data.params.get("tune.metric", ""),
        "mode": run.data.params.get("tune.mode", "max"),
        "trials": [child.info.run_id for child in children],
    }


def fetch_runs(tracking_uri: str, run_ids: list[str]) -> list[dict[str, Any]]:
    """What ``raytrain report`` shows of each run: its name, params, latest metrics and every
    metric's history as (step, value) pairs, by step. An unknown run id is a
    ``TrackingError`` naming it. A local store that does not exist is one too: reading it
    must not create it (MLflow would, an empty ``mlflow.db``); a server that does not
    answer is a ``TrackingUnreachable``."""
    client = _reader(tracking_uri)
    with _reading(tracking_uri):
        return [_fetch_run(client, tracking_uri, run_id) for run_id in run_ids]


def _fetch_run(client: MlflowClient, tracking_uri: str, run_id: str) -> dict[str, Any]:
    """``fetch_runs``' record of one run."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        _raise_if_unreached(exc, tracking_uri)
        raise TrackingError(
            f"run {run_id}: not found at {redact(tracking_uri)} ({exc.error_code})"
        ) from None
    histories = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        for key in run.data.metrics
    }
    return {
        "run_id": run_id,
        "name": run.info.run_name or run_id[:8],
        "status": run.info.status,
        "params": dict(run.data.params),
        "metrics": dict(run.data.metrics),
        "tags": dict(run.data.tags),
        "histories": histories,
    }
