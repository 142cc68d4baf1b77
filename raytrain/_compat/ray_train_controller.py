"""The parts of Ray Train's internals that run in its controller's process and the
placement-group cleaner's, written for Ray 2.60 (``versions.SUPPORTED``), apart from
``_compat.ray_train``, whose ``TorchTrainer`` imports torch.

Ray unpickles an actor's class, and what its arguments hold, by importing their modules.
The placement-group cleaner imported torch through ``_compat.ray_train``: 3.7-4.1 s of
CPU (user and system, 3 imports) against 1.9-2.0 s for this module, in a process of every
run on a cluster that outlives it. This module imports no torch, and
``tests/unit/test_compat.py`` keeps it so. The controller imports torch anyway, through
the ``TorchConfig`` it is given. What each entry relies on is listed in
``_compat.ray_train``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import ray
from ray._common.constants import (
    HEAD_NODE_RESOURCE_NAME,
    RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
)
from ray._private.state import actors as gcs_actors
from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)
from ray.train.v2._internal.constants import (
    DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
    get_env_vars_to_propagate,
)
from ray.train.v2._internal.execution.callback import WorkerGroupCallback
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.controller.placement_group_cleaner import (
    PlacementGroupCleaner,
)
from ray.train.v2._internal.execution.failure_handling import (
    DefaultFailurePolicy,
    FailureDecision,
)
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy
from ray.train.v2._internal.execution.worker_group import WorkerGroup

if TYPE_CHECKING:
    from ray.runtime_env import RuntimeEnv
    from ray.train.v2._internal.execution.context import TrainRunContext
    from ray.train.v2.api.exceptions import TrainingFailedError

logger = logging.getLogger(__name__)


class Policy(Protocol):
    """What decides first (``raytrain.driver.failure_policy.FailurePolicy``): a decision
    whose ``value`` is ``"RAISE"``, ``"RETRY"`` or ``"DEFER"`` (Ray's default decides)."""

    def decide(self, errors: Iterable[BaseException | None]) -> Any: ...


def controller_env() -> dict[str, str]:
    """The environment variables Ray Train gives its controller (and its actors)."""
    env = get_env_vars_to_propagate()
    env.setdefault(
        RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE
    )
    return env


class OnWorkerGroupStart(WorkerGroupCallback):
    """Runs ``fn`` in every worker process once the group has started (on each worker
    actor's main thread, where Python allows signal handlers). ``fn`` must be picklable."""

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn

    def after_worker_group_start(self, worker_group: WorkerGroup) -> None:
        worker_group.execute(self.fn)


class GcsPlacementGroupCleaner(PlacementGroupCleaner):
    """Ray Train's placement-group cleaner, told of the controller's death by the GCS.

    Ray's asks the dashboard's state API, and on a cluster without a dashboard (raytrain's
    embedded one) each ask fails and it keeps waiting: a controller killed with its caller
    (a sweep's trial that ASHA stopped) then left its placement group holding the CPUs
    until the job ended, and the next trial waited for them without end. The GCS is what
    the state API reads from, and every cluster has one."""

    def _monitor_loop(self) -> None:
        group = None
        while not self._stop_event.is_set():
            with contextlib.suppress(queue.Empty):
                group = self._pg_queue.get(timeout=self._check_interval_s)
            try:
                alive = gcs_actors(self._controller_actor_id).get("State", "DEAD") != "DEAD"
            except Exception:  # the GCS restarting: ask again, as Ray's cleaner does
                logger.warning("the GCS did not answer about the controller", exc_info=True)
                continue
            if alive:
                continue
            while not self._pg_queue.empty():  # a group registered as the controller died
                group = self._pg_queue.get_nowait()
            self._cleanup_placement_group(group)
            break
        self._exit()
        self._monitor_thread = None


class GcsPlacementGroupCleanerCallback(PlacementGroupCleanerCallback):
    """Ray's callback, starting ``GcsPlacementGroupCleaner`` (detached: it outlives the
    controller it watches) in place of Ray's cleaner."""

    def after_controller_start(self, train_run_context: TrainRunContext) -> None:
        self._controller_actor_id = ray.get_runtime_context().get_actor_id()
        cleaner: Any = ray.remote(num_cpus=0)(GcsPlacementGroupCleaner)  # untyped in Ray
        try:
            self._cleaner = cleaner.options(
                lifetime="detached",
                resources={HEAD_NODE_RESOURCE_NAME: 0.001},
                scheduling_strategy="DEFAULT",  # outside a placement group its caller runs in
            ).remote(
                controller_actor_id=self._controller_actor_id,
                check_interval_s=self._check_interval_s,
                get_actor_timeout_s=self._get_actor_timeout_s,
                stop_timeout=self._stop_timeout,
            )
        except Exception:  # as Ray's callback: the run goes on without a cleaner
            logger.warning("the placement-group cleaner could not start", exc_info=True)
            self._cleaner = None
            return
        self._cleaner.start_monitoring.remote()  # type: ignore[union-attr]


class PolicyAdapter(DefaultFailurePolicy):
    """Ray Train's default policy, with raytrain's ``FailurePolicy`` deciding first; what
    it defers is Ray's (counted against ``max_failures``)."""

    def __init__(self, failure_config: Any, policy: Policy):
        super().__init__(failure_config)
        self.policy = policy

    def make_decision(self, training_failed_error: TrainingFailedError) -> FailureDecision:
        failures = getattr(training_failed_error, "worker_failures", None) or {}
        decision = self.policy.decide(failures.values()).value
        if decision == "RAISE":
            return FailureDecision.RAISE
        if decision == "RETRY":
            return FailureDecision.RETRY
        return super().make_decision(training_failed_error)


class LocalScalingPolicy(FixedScalingPolicy):
    """A fixed worker count that asks no autoscaler for resources: the cluster is this
    machine, and a reservation it cannot satisfy is refused in preflight."""

    def after_controller_start(self, train_run_context: TrainRunContext) -> None:
        return None

    def _maybe_send_resource_request(self) -> None:
        return None

    async def before_controller_shutdown(self) -> None:
        return None


class InheritedEnvWorkerGroup(WorkerGroup):
    """``WorkerGroup`` whose workers get no runtime environment of Ray Train's making.

    Ray Train gives every worker the ``RAY_TRAIN_*`` variables its driver had, as a runtime
    environment. A worker with a runtime environment can only run in a process started for
    it, never in one of the raylet's idle (prestarted, preloaded) processes. On a cluster
    raytrain started, every process has those variables from the start, so the runtime
    environment adds nothing and costs each worker a cold process.
    """

    @staticmethod
    def _get_worker_runtime_env(
        custom_runtime_env: dict[Any, Any] | RuntimeEnv,
    ) -> dict[Any, Any]:
        return dict(custom_runtime_env)


class InheritingController(TrainController):
    """``TrainController`` whose worker groups are ``InheritedEnvWorkerGroup``s."""

    worker_group_cls = InheritedEnvWorkerGroup
