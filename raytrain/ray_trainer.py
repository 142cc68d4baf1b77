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

``RaytrainTorchTrainer`` is trimmed for an embedded cluster (``embedded_env`` given) and
stock for a cluster joined through ``RAY_ADDRESS``. Both keep the controller's handle so a
run can be aborted from the driver (``abort``). The trimming uses Ray Train internals of the pinned
Ray version (2.60); if they are not there, the stock behaviour is used.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import ray
from ray.train.torch import TorchTrainer

from raytrain.errors import NonFiniteLossError
from raytrain.preemption import NoticeCallback, PreemptedError

logger = logging.getLogger(__name__)

# Set to 1 to run Ray Train's stock startup even on an embedded cluster (for comparison).
STOCK_ENV = "RAYTRAIN_STOCK_TRAINER"

try:  # Ray Train internals the trimming needs (Ray 2.60)
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback,
    )
    from ray.train.v2._internal.constants import (
        DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
        get_env_vars_to_propagate,
    )
    from ray.train.v2._internal.execution.controller import TrainController
    from ray.train.v2._internal.execution.failure_handling import (
        DefaultFailurePolicy,
        FailureDecision,
    )
    from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy

    _INTERNALS = True
except ImportError:  # pragma: no cover - another Ray version
    _INTERNALS = False


class RunAborted(Exception):
    """``fit`` ended because ``abort`` was called."""


def controller_env() -> dict[str, str]:
    """The environment variables Ray Train gives its controller (and its actors)."""
    env = get_env_vars_to_propagate()
    env.setdefault(
        RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE
    )
    return env


class RaytrainTorchTrainer(TorchTrainer):
    """``TorchTrainer`` that keeps its controller's handle and, with ``embedded_env`` (the
    environment the embedded cluster was started with), skips what only a shared or
    autoscaling cluster needs."""

    def __init__(self, *args: Any, embedded_env: dict[str, str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._embedded_env = embedded_env
        self._controller: Any = None
        self._aborted = threading.Event()

    @property
    def trimmed(self) -> bool:
        """Whether this run skips Ray Train's cluster helpers (see the module docstring)."""
        return bool(self._embedded_env is not None and _INTERNALS and not os.getenv(STOCK_ENV))

    def abort(self) -> None:
        """Stop the run: the controller shuts the workers down and ``fit`` raises."""
        self._aborted.set()
        if self._controller is not None:
            self._controller.abort.remote()

    def _create_default_callbacks(self) -> list[Any]:
        callbacks = super()._create_default_callbacks()
        if _INTERNALS:
            callbacks.append(NoticeCallback())  # a SIGTERM to a worker: a preemption notice
        if not self.trimmed:
            return callbacks
        drop: tuple[type, ...] = (PlacementGroupCleanerCallback,)
        if not self.datasets:
            drop += (DatasetsCallback,)
        return [cb for cb in callbacks if not isinstance(cb, drop)]

    def _initialize_and_run_controller(self, **controller_kwargs: Any) -> Any:
        if not _INTERNALS:  # pragma: no cover - another Ray version
            return super()._initialize_and_run_controller(**controller_kwargs)
        env = controller_env()
        options: dict[str, Any] = {
            "num_cpus": 0,
            "label_selector": {
                ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()
            },
        }
        # The cluster's processes already have these variables when they are the ones this
        # process started the cluster with; then no runtime environment is needed.
        inherited = self.trimmed and all(self._embedded_env.get(k) == v for k, v in env.items())
        policy = controller_kwargs["scaling_policy"]
        if inherited and isinstance(policy, FixedScalingPolicy):  # elastic stays Ray's own
            controller_kwargs["scaling_policy"] = LocalScalingPolicy(policy.scaling_config)
        else:
            options["runtime_env"] = {"env_vars": env}
        controller_kwargs["failure_policy"] = RaytrainFailurePolicy(self.run_config.failure_config)
        controller = ray.remote(**options)(TrainController).remote(**controller_kwargs)
        self._controller = controller
        if self._aborted.is_set():  # abort() came before the controller existed
            controller.abort.remote()
        if threading.current_thread() is threading.main_thread():
            self._register_sigint_handler(controller)
        try:
            ray.get(controller.run.remote())
            return ray.get(controller.get_result.remote())
        except ray.exceptions.RayActorError:
            if self._aborted.is_set():  # abort() ends the controller's process
                raise RunAborted("the run was aborted") from None
            raise


if _INTERNALS:

    class RaytrainFailurePolicy(DefaultFailurePolicy):
        """Ray Train's policy, except that a non-finite loss is never retried (see
        ``raytrain.guards``), and that workers stopped by a SIGTERM notice (they raise
        ``PreemptedError`` once their checkpoint is committed) are a preemption: retried
        against ``max_preemption_failures``, as Ray does for a node drained for preemption,
        not against ``max_failures``."""

        def make_decision(self, training_failed_error: Any) -> Any:
            failures = getattr(training_failed_error, "worker_failures", None) or {}
            if any(_wraps(error, NonFiniteLossError) for error in failures.values()):
                return FailureDecision.RAISE
            if failures and all(_wraps(e, PreemptedError) for e in failures.values()):
                self._preemption_failures += 1
                limit = self.failure_config.max_preemption_failures
                if limit != -1 and self._preemption_failures > limit:
                    return FailureDecision.RAISE
                logger.warning("preempted (%d so far): restarting from its checkpoint",
                               self._preemption_failures)  # fmt: skip
                return FailureDecision.RETRY
            return super().make_decision(training_failed_error)

    def _wraps(error: BaseException | None, kind: type[BaseException]) -> bool:
        """Whether a worker's error is (or wraps) an error of type ``kind``."""
        seen = 0
        while error is not None and seen < 10:
            if type(error).__name__ == kind.__name__:
                return True
            error, seen = getattr(error, "cause", None) or error.__cause__, seen + 1
        return False

    class LocalScalingPolicy(FixedScalingPolicy):
        """A fixed worker count that asks no autoscaler for resources: the cluster is this
        machine, and a reservation it cannot satisfy is refused in preflight."""

        def after_controller_start(self, train_run_context: Any) -> None:
            return None

        def _maybe_send_resource_request(self) -> None:
            return None

        async def before_controller_shutdown(self) -> None:
            return None
