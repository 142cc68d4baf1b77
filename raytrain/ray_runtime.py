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
from dataclasses import dataclass

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


@dataclass
class RayHandle:
    started_here: bool
    address: str | None

    def resources(self) -> dict[str, float]:
        import ray

        return dict(ray.cluster_resources())

    def object_store_bytes(self) -> float:
        return self.resources().get("object_store_memory", 2e9)

    def shutdown(self) -> None:
        import ray

        if self.started_here and ray.is_initialized():
            ray.shutdown()


def cluster_address() -> str | None:
    """The cluster to join, from ``RAY_ADDRESS``; None means start one here."""
    return os.environ.get("RAY_ADDRESS") or None


def local_cpus(spec: JobSpec) -> int:
    """Logical CPUs for an embedded cluster: the workers' plus Ray Data's budget."""
    per_worker = spec.scaling.worker_resources().get("CPU", 1.0)
    return math.ceil(per_worker * spec.scaling.num_workers) + DATA_CPUS


def connect(spec: JobSpec, *, verbose: bool = False) -> RayHandle:
    """Join ``RAY_ADDRESS``, reuse an already initialised Ray, or start a sized local one."""
    import ray

    _quiet_ray(verbose)
    if ray.is_initialized():
        return RayHandle(started_here=False, address=None)
    address = cluster_address()
    if address:
        ray.init(address=address, log_to_driver=verbose, logging_level=logging.WARNING)
        return RayHandle(started_here=True, address=address)
    # Processes of a cluster started here inherit this environment, the controller too.
    os.environ.setdefault(_POLL_ENV, CONTROLLER_POLL_S)
    os.environ.setdefault(_NICENESS_ENV, "0")
    os.environ.setdefault(_METRICS_ENV, "0")
    ray.init(
        num_cpus=local_cpus(spec),
        include_dashboard=False,
        log_to_driver=verbose,
        logging_level=logging.WARNING,
    )
    return RayHandle(started_here=True, address=None)


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
    for name in ("ray.data._internal.progress", "ray._private.authentication"):
        logging.getLogger(name).setLevel(logging.ERROR)
