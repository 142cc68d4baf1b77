"""The TorchTrainer a run uses: Ray Train's own, trimmed when raytrain started the cluster.

Besides its training workers, Ray Train's ``TorchTrainer.fit`` starts a controller actor with
a runtime environment of its own and three helper actors: a placement-group cleaner (removes
the workers' reservation if the controller dies), an autoscaling coordinator (asks a cluster
autoscaler for the workers' resources) and a dataset manager (shards Ray Datasets). On a
cluster started by this process for this one run none of the helpers has work: nothing
autoscales, the cluster dies with the run, and a job whose data is cached passes no Ray
Dataset. The runtime environment (only environment variables this process has already given
the cluster) keeps the controller and every actor it starts from using the worker processes
Ray prestarted while the cluster came up. Each helper is a new Python process importing Ray
Train and Ray Data: on a 2-core machine, about 1.5-3 CPU-seconds each, spent while the
training workers import torch and Lightning.

``build_trainer`` trims for an embedded cluster (``embedded_env`` given) and not for a
cluster joined through ``RAY_ADDRESS``. The placement-group cleaner stays unless the run
started the cluster itself: on an embedded cluster that outlives the run (a pipeline's
``start_local``, a sweep's) a controller killed with its caller (a sweep's trial that ASHA
stopped) leaves its placement group behind, since Ray removes one only once both its
creator and its job are gone, and the next runs wait for CPUs that never free. Either way
the controller gets raytrain's ``FailurePolicy`` and every worker the SIGTERM notice
handler, and the run can be aborted from the driver (``abort``). How:
``raytrain._compat.ray_train``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from raytrain._compat.ray_train import ControllerTrainer, RunAborted
from raytrain._compat.ray_train_controller import OnWorkerGroupStart
from raytrain.driver.failure_policy import FailurePolicy
from raytrain.worker.entry import on_group_start

__all__ = ["STOCK_ENV", "RunAborted", "build_trainer"]

# Set to 1 to run Ray Train's stock startup even on an embedded cluster (for comparison).
STOCK_ENV = "RAYTRAIN_STOCK_TRAINER"


def build_trainer(
    *,
    embedded_env: dict[str, str] | None,
    ends_with_run: bool,
    max_preemptions: int,
    notify: Callable[[str], None] | None = None,
    injected: Callable[[], bool] | None = None,
    requested: Callable[[], bool] | None = None,
    **trainer_kwargs: Any,
) -> ControllerTrainer:
    """The run's trainer (``trainer_kwargs``: ``TorchTrainer``'s own arguments); ``notify``
    is told each worker-group failure, ``injected`` says whether one was injected,
    ``requested`` whether the driver asked the run to stop at a checkpoint
    (``FailurePolicy``). ``ends_with_run``: this run started the cluster, which ends with
    it."""
    return ControllerTrainer(
        policy=FailurePolicy(max_preemptions, notify, injected, requested),
        trimmed=embedded_env is not None and not os.getenv(STOCK_ENV),
        ends_with_run=ends_with_run,
        embedded_env=embedded_env,
        group_callbacks=[OnWorkerGroupStart(on_group_start)],
        **trainer_kwargs,
    )
