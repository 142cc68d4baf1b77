"""Starting or joining Ray for one run.

With ``RAY_ADDRESS`` set (``ray job submit`` sets it too) the run joins that cluster. Without
it, an embedded local Ray is started and sized on purpose: the training workers' CPUs plus a
budget for Ray Data. Ray Train reserves the workers' CPUs, and Ray Data schedules its read
tasks only in what is left; with nothing left, a read never runs and the job hangs.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain.driver import cluster_record
from raytrain.driver.cluster_watch import ClusterWatch
from raytrain.driver.warm_pool import PRELOAD_CONFIG, WarmPool, local_raylet_address
from raytrain.errors import ClusterUnreachable, one_line
from raytrain.spec import JobSpec

# Logical CPUs an embedded cluster keeps for Ray Data beyond the training workers.
DATA_CPUS = 2

# How often Ray Train's controller polls workers. A checkpoint report waits in a one-slot
# queue until the next poll, and the end of training is noticed only then: Ray's default of
# 2 s cost up to 2 s per checkpoint. Polling twice a second costs the controller little.
CONTROLLER_POLL_S = "0.5"
_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"

# Ray starts worker processes at nice 15, below its own daemons and the driver. Training
# workers are what the cluster is for: at nice 15 on a busy machine every daemon tick
# preempts one rank and the other waits for it at the next all-reduce (measured here: the
# compute-bound model's step 80 ms at nice 15, 76 ms at 0, against 67 ms hand-written).
_NICENESS_ENV = "RAY_worker_niceness"

# Every Ray process exports metrics for a dashboard that an embedded cluster does not run;
# on 2 cores that cost the training workers about 6% of the machine (Ray Data's stats actor
# alone 3-4%). A cluster joined through RAY_ADDRESS keeps its own setting.
_METRICS_ENV = "RAY_enable_metrics_collection"


# Ray Train gives its controller this variable through a runtime environment; an embedded
# cluster has it from the start, so the controller needs none (see driver.trainer).
_ASYNC_GET_WARN_ENV = "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"

# Ray Train features for clusters an embedded one is not: a watcher actor for cloud node
# preemption, and per-report metrics for a Prometheus nothing scrapes here.
_PREEMPTION_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
_TRAIN_METRICS_ENV = "RAY_TRAIN_METRICS_ENABLED"

# Ray's token authentication mode: set by ``ray.init`` for a new local cluster, and by
# ``join_up`` for the cluster ``raytrain up`` started.
AUTH_MODE_ENV = "RAY_AUTH_MODE"

# What an embedded cluster's processes get unless the caller has set the variable already.
EMBEDDED_ENV = {
    _POLL_ENV: CONTROLLER_POLL_S,
    _NICENESS_ENV: "0",
    _METRICS_ENV: "0",
    _ASYNC_GET_WARN_ENV: "0",
    _PREEMPTION_ENV: "0",
    _TRAIN_METRICS_ENV: "0",
}


@dataclass
class RayHandle:
    started_here: bool
    address: str | None
    # The environment an embedded cluster's processes inherited; None for a joined cluster.
    embedded_env: dict[str, str] | None = None
    # What starting the embedded cluster changed in this process's environment, undone by
    # ``shutdown`` (see ``EnvChanges``); None for a joined cluster.
    env_changes: EnvChanges | None = field(default=None, repr=False)
    # The idle preloaded worker processes an embedded cluster keeps (see driver.warm_pool).
    pool: WarmPool | None = field(default=None, repr=False)
    # On the cluster `raytrain up` started: notices it going away (driver.cluster_watch).
    watch: ClusterWatch | None = field(default=None, repr=False)

    def cluster_lost(self) -> bool:
        """Whether the cluster ``raytrain up`` started went away while this run used it."""
        return self.watch is not None and self.watch.lost.is_set()

    @property
    def ends_with_run(self) -> bool:
        """Whether the cluster stops when this handle shuts down: one started here."""
        return self.started_here and self.address is None and self.embedded_env is not None

    def resources(self) -> dict[str, float]:
        import ray

        return dict(ray.cluster_resources())

    def object_store_bytes(self) -> float:
        return self.resources().get("object_store_memory", 2e9)

    def shutdown(self, *, restore_env: bool = True) -> None:
        """Leave Ray, stopping the cluster if this handle started it; with ``restore_env``
        also ``restore_env()`` (a caller that runs this in a thread does that itself, on
        its own thread: ``os.environ`` is not safe to change beside a reader)."""
        import ray

        global _started_env
        if self.watch is not None:
            self.watch.stop()
        if self.pool is not None:
            self.pool.stop()
            self.pool = None
        if self.started_here and ray.is_initialized():
            ray.shutdown()
            _started_env = None
        if restore_env:
            self.restore_env()

    def restore_env(self) -> None:
        """Put back what starting or joining the cluster changed in ``os.environ``."""
        if self.env_changes is not None:  # the cluster is gone: nothing needs them now
            self.env_changes.undo(os.environ)
            self.env_changes = None


@dataclass(frozen=True)
class EnvChanges:
    """The variables an embedded cluster's start changed in the caller's environment:
    ``before`` holds each one's earlier value (None: it was not set), ``after`` the value the
    start left. ``undo`` puts back the earlier values, except where the caller has since
    set a variable to something else: the caller's later choice is kept."""

    before: dict[str, str | None]
    after: dict[str, str | None]

    @classmethod
    def between(cls, before: Mapping[str, str], after: Mapping[str, str]) -> EnvChanges:
        """The changes from the environment ``before`` to the environment ``after``."""
        keys = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        return cls({k: before.get(k) for k in keys}, {k: after.get(k) for k in keys})

    def undo(self, environ: MutableMapping[str, str]) -> None:
        """Restore ``environ`` (this process's ``os.environ``) to its values before."""
        for key, earlier in self.before.items():
            if environ.get(key) != self.after[key]:
                continue  # changed again since the start: the caller's value stays
            if earlier is None:
                environ.pop(key, None)
            else:
                environ[key] = earlier


def cluster_address() -> str | None:
    """The cluster to join, from ``RAY_ADDRESS``; None means start one here."""
    return os.environ.get("RAY_ADDRESS") or None


def joins_cluster() -> bool:
    """Whether a run will join a cluster rather than this machine's embedded one:
    ``RAY_ADDRESS`` is set, ``raytrain up`` has a cluster up, or this process is already
    connected to a cluster that ``start_local`` did not start (a pipeline's own
    ``ray.init``)."""
    if cluster_address() or cluster_record.running() is not None:
        return True
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized() and _started_env is None)


# Ray's job server gives a job's driver its submission id in this variable (JSON metadata).
_JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def submission_id() -> str | None:
    """The Ray job id (``raysubmit_...`` or the ``--job-id`` given) when this process is a
    submitted job's driver; None for a run started by hand."""
    import json

    try:
        metadata = json.loads(os.environ.get(_JOB_CONFIG_ENV, "{}")).get("metadata") or {}
    except ValueError:
        return None
    return metadata.get("job_submission_id") or None


# Logical CPUs to give an embedded cluster instead of the workers' plus DATA_CPUS.
LOCAL_CPUS_ENV = "RAYTRAIN_LOCAL_CPUS"


def workers_cpus(spec: JobSpec) -> int:
    """Logical CPUs the training workers reserve."""
    per_worker = spec.scaling.worker_resources().get("CPU", 1.0)
    return math.ceil(per_worker * spec.scaling.max_workers)


def local_cpus(spec: JobSpec) -> int:
    """Logical CPUs for an embedded cluster: ``$RAYTRAIN_LOCAL_CPUS``, else the workers'
    plus Ray Data's budget. ``preflight.check_local_cpus`` has checked the variable."""
    requested = os.environ.get(LOCAL_CPUS_ENV)
    return int(requested) if requested else workers_cpus(spec) + DATA_CPUS


# The environment of the cluster ``start_local`` started in this process, while it runs.
_started_env: dict[str, str] | None = None


def start_local(
    num_cpus: int,
    *,
    verbose: bool = False,
    warm: int = 0,
    warm_marks: Path | None = None,
    **init_kwargs: Any,
) -> RayHandle:
    """Start an embedded Ray on this machine with ``num_cpus`` logical CPUs.

    A pipeline that trains several jobs can start one and let every ``fit`` reuse it (each
    ``fit`` then skips Ray's startup); ``fit`` starts one itself, sized for its job, when no
    Ray is running. With ``warm`` > 0 the cluster keeps that many idle worker processes
    with torch, Lightning and raytrain's worker modules imported (``driver.warm_pool``):
    worth it on a cluster that waits between runs (``raytrain up``), not on one that
    starts with its run, where the pool's imports compete with the run's own
    (``docs/decisions/002-*``). ``init_kwargs`` go to ``ray.init`` (``object_store_memory``,
    ...); ``warm_marks``: the folder where warm processes mark
    themselves ready (``worker.warm_ready``), so that the pool imports one at a time.
    """
    global _started_env
    before = dict(os.environ)  # before Ray's import too, which sets RAY_CLIENT_MODE
    import ray

    _quiet_ray(verbose)
    # Processes of a cluster started here inherit this environment, the controller too. The
    # driver needs them as long as the cluster runs: Ray Train reads RAY_TRAIN_METRICS_ENABLED
    # in the driver at each fit, and driver.trainer compares the controller's variables, read
    # from this environment, with the cluster's. ``RayHandle.shutdown`` takes them back, with
    # what ``ray.init`` itself sets here (PYTHONBREAKPOINT, RAY_USAGE_STATS_ENABLED, ...).
    for key, value in EMBEDDED_ENV.items():
        os.environ.setdefault(key, value)
    env = dict(os.environ)
    system_config = {**(PRELOAD_CONFIG if warm else {}), **init_kwargs.pop("_system_config", {})}
    try:
        ray.init(
            # a new cluster here even when `ray start` left one on this machine: joining a
            # cluster is what RAY_ADDRESS asks for
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=verbose,
            logging_level=logging.WARNING,
            _system_config=system_config or None,
            **init_kwargs,
        )
    except BaseException:
        EnvChanges.between(before, os.environ).undo(os.environ)
        raise
    _started_env = env
    changes = EnvChanges.between(before, os.environ)
    pool = None
    if warm > 0:
        pool = WarmPool(local_raylet_address(), warm, marks=warm_marks).start()
    return RayHandle(
        started_here=True, address=None, embedded_env=env, env_changes=changes, pool=pool
    )


def adopt_embedded(env: dict[str, str] | None) -> None:
    """Say that this process runs inside an embedded cluster another raytrain process
    started with ``env`` (a sweep's trial actor, on its driver's cluster), so its runs take
    the trimmed start an embedded cluster allows (``driver.trainer``)."""
    global _started_env
    _started_env = env


def connect(spec: JobSpec, *, verbose: bool = False) -> RayHandle:
    """Join ``RAY_ADDRESS``, reuse an already initialised Ray, or start a sized local one."""
    import ray

    _quiet_ray(verbose)
    if ray.is_initialized():
        # a cluster start_local started is still the embedded one; another is unknown
        return RayHandle(started_here=False, address=None, embedded_env=_started_env)
    address = cluster_address()
    if address:
        ray.init(address=address, log_to_driver=verbose, logging_level=logging.WARNING)
        return RayHandle(started_here=True, address=address)
    up = cluster_record.running()
    if up is not None:
        return join_up(up, verbose=verbose)
    return start_local(local_cpus(spec), verbose=verbose)


def join_up(up: cluster_record.ClusterRecord, *, verbose: bool = False) -> RayHandle:
    """Join the cluster ``raytrain up`` started, saying so in one line. Its processes were
    started with ``EMBEDDED_ENV``; this driver takes the same values (Ray Train reads some
    in the driver), undone at ``shutdown``, so the run is trimmed as on an embedded
    cluster and its workers can take the cluster's warm processes."""
    import ray

    print(
        f"raytrain: joining the cluster `raytrain up` started, {up.describe()}",
        file=sys.stderr,
        flush=True,
    )
    from raytrain._compat.ray_core import refresh_auth_mode

    before = dict(os.environ)
    for key, value in up.embedded_env.items():
        os.environ.setdefault(key, value)
    if os.environ.get(AUTH_MODE_ENV) != before.get(AUTH_MODE_ENV):
        refresh_auth_mode()
    try:
        ray.init(address=up.address, log_to_driver=verbose, logging_level=logging.WARNING)
    except BaseException as exc:
        EnvChanges.between(before, os.environ).undo(os.environ)
        if isinstance(exc, Exception):  # Ray's connection or authentication error
            raise ClusterUnreachable(
                f"the cluster `raytrain up` started ({up.address}) does not answer: "
                f"{one_line(exc)}; `raytrain down` stops what is left of it (a run then "
                "starts its own cluster), `raytrain up` starts a new one"
            ) from exc
        raise
    changes = EnvChanges.between(before, os.environ)
    return RayHandle(
        started_here=True,
        address=up.address,
        embedded_env=up.embedded_env,
        env_changes=changes,
        watch=ClusterWatch(up).start(),
    )


def _quiet_ray(verbose: bool) -> None:
    """Keep Ray's own progress bars and INFO lines out of the user's terminal."""
    if verbose:
        return
    from ray.data import DataContext

    context = DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    for name in ("ray.data", "ray.train", "ray.tune", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Notices about choices made here on purpose: progress bars off (raytrain draws its
    # own line) and token authentication on (the safe default; the README says so).
    from raytrain._compat.ray_core import NOISY_LOGGERS

    for key in ("data_progress", "authentication"):
        logging.getLogger(NOISY_LOGGERS[key]).setLevel(logging.ERROR)
