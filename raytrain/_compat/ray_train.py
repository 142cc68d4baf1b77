"""Ray Train internals raytrain relies on, written for Ray 2.60 (``versions.SUPPORTED``).

The parts that run in the controller's process are in ``_compat.ray_train_controller``
(no torch there); their entries are listed here. Ray Train V2's public API has no way to
give its controller a failure policy, to skip the helper actors a single-machine run never
uses, to keep the controller's handle, to run code in every worker process when the group
starts, or to read a worker's preemption notice without a barrier. These two modules do
each through ``ray.train.v2._internal``, and nowhere else does raytrain touch it.
``tests/unit/test_compat.py`` pins what each entry relies on.

- ``ControllerTrainer``: ``TorchTrainer`` overriding ``_create_default_callbacks`` (adds
  worker-group callbacks; drops ``WorkingDirectorySetupCallback``, so that the workers
  stay in the directory Ray started them in, and when trimmed, without Ray Datasets,
  ``DatasetsCallback``, and ``PlacementGroupCleanerCallback`` where the cluster ends with
  the run) and ``_initialize_and_run_controller``
  (starts ``TrainController`` itself: on the driver's node, with 0 CPUs, with the policy
  given, with a runtime env only when the cluster's processes lack the controller's
  variables; ends it, and puts the caller's SIGINT handler back, when the run is over).
  Relies on those two methods' names and ``controller_kwargs`` keys (``scaling_policy``,
  ``failure_policy``), and on ``_register_sigint_handler``.
- ``PolicyAdapter``: ``DefaultFailurePolicy`` with a decision taken first
  (``make_decision(training_failed_error)``, ``FailureDecision.RAISE/RETRY``).
- ``LocalScalingPolicy``: ``FixedScalingPolicy`` without autoscaler requests.
- ``InheritingController``: ``TrainController`` with ``worker_group_cls`` an
  ``InheritedEnvWorkerGroup``, a ``WorkerGroup`` overriding the static
  ``_get_worker_runtime_env(custom_runtime_env)``: workers get no runtime environment of
  Ray Train's making where the cluster's processes already have its variables, so they
  can start in the raylet's warm processes. Used when the controller needs none either.
- ``OnWorkerGroupStart``: a ``WorkerGroupCallback`` (``after_worker_group_start``).
- ``worker_preemption_info``: ``get_train_context().preemption_context.preemption_info``.
- ``GcsPlacementGroupCleanerCallback``: ``PlacementGroupCleanerCallback`` starting a
  ``PlacementGroupCleaner`` that asks the GCS (``ray._private.state.actors``), not the
  dashboard, whether the controller lives. Relies on the cleaner's ``_pg_queue``,
  ``_stop_event``, ``_check_interval_s``, ``_controller_actor_id``,
  ``_cleanup_placement_group``, ``_exit`` and ``_monitor_thread``, and on the callback's
  ``_check_interval_s``, ``_get_actor_timeout_s``, ``_stop_timeout``, ``_cleaner`` and
  ``_controller_actor_id``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray._raylet import RAY_NODE_ID_KEY  # type: ignore[attr-defined]  # Cython: no stub
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)
from ray.train.v2._internal.callbacks.working_dir_setup import WorkingDirectorySetupCallback
from ray.train.v2._internal.execution.context import get_train_context
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy
from ray.train.v2.torch.torch_trainer import TorchTrainer

from raytrain._compat.ray_train_controller import (
    GcsPlacementGroupCleanerCallback,
    InheritingController,
    LocalScalingPolicy,
    Policy,
    PolicyAdapter,
    controller_env,
)

if TYPE_CHECKING:
    from ray.train import Result
    from ray.train.v2._internal.execution.callback import RayTrainCallback
    from ray.train.v2.api.preemption import PreemptionInfo


class RunAborted(Exception):
    """``fit`` ended because ``abort`` was called."""


def worker_preemption_info() -> PreemptionInfo | None:
    """Ray Train's preemption info for this worker (a node of the group drains for a
    preemption), or None. Read locally: no barrier, unlike ``ray.train.get_preemption_info``."""
    try:
        return get_train_context().preemption_context.preemption_info
    except (AttributeError, RuntimeError):  # not inside a Ray Train worker
        return None


def _gcs_cleaner(callback: RayTrainCallback) -> RayTrainCallback:
    """Ray's placement-group cleaner callback (made with its defaults) as
    ``GcsPlacementGroupCleanerCallback``; any other callback as it is."""
    is_rays = type(callback) is PlacementGroupCleanerCallback
    return GcsPlacementGroupCleanerCallback() if is_rays else callback


class ControllerTrainer(TorchTrainer):
    """``TorchTrainer`` that starts its controller itself (see the module docstring).

    ``trimmed``: skip what only a shared or autoscaling cluster needs; ``ends_with_run``:
    the cluster ends with this run, so a placement group its controller leaves behind (a
    controller killed with its caller: a sweep's stopped trial) needs no cleaner, since
    Ray removes a placement group only once both its creator and its job are gone;
    ``embedded_env``:
    the environment the cluster's processes were started with (None: unknown, give the
    controller its runtime env); ``policy``: raytrain's failure decisions;
    ``group_callbacks``: worker-group callbacks added to Ray Train's own.
    """

    def __init__(
        self,
        *args: Any,
        policy: Policy,
        trimmed: bool = False,
        ends_with_run: bool = False,
        embedded_env: dict[str, str] | None = None,
        group_callbacks: Sequence[RayTrainCallback] = (),
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self._policy = policy
        self._trimmed = trimmed
        self._ends_with_run = ends_with_run
        self._embedded_env = embedded_env
        self._group_callbacks = list(group_callbacks)
        self._controller: Any = None
        self._aborted = threading.Event()

    def abort(self) -> None:
        """Stop the run: the controller shuts the workers down and ``fit`` raises."""
        self._aborted.set()
        if self._controller is not None:
            self._controller.abort.remote()

    def _create_default_callbacks(self) -> list[RayTrainCallback]:
        callbacks = [*super()._create_default_callbacks(), *self._group_callbacks]
        # Ray Train moves every worker into its own artifacts folder; the workers stay where
        # Ray started them instead (the driver's directory on a local cluster, the job's
        # working dir on a cluster), so a relative path in the user's code (a DataModule's
        # data_dir) means what it means to `python train.py`.
        drop: tuple[type, ...] = (WorkingDirectorySetupCallback,)
        if self._trimmed and self._ends_with_run:
            drop += (PlacementGroupCleanerCallback,)
        if self._trimmed and not self.datasets:
            drop += (DatasetsCallback,)
        return [_gcs_cleaner(cb) for cb in callbacks if not isinstance(cb, drop)]

    def _initialize_and_run_controller(self, **controller_kwargs: Any) -> Result:
        env = controller_env()
        options: dict[str, Any] = {
            "num_cpus": 0,
            "label_selector": {RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
        }
        # The cluster's processes already have these variables when they are the ones this
        # process started the cluster with; then no runtime environment is needed.
        started_with = self._embedded_env or {}
        inherited = self._trimmed and all(started_with.get(k) == v for k, v in env.items())
        policy = controller_kwargs["scaling_policy"]
        if inherited and isinstance(policy, FixedScalingPolicy):  # elastic stays Ray's own
            controller_kwargs["scaling_policy"] = LocalScalingPolicy(policy.scaling_config)
        if not inherited:
            options["runtime_env"] = {"env_vars": env}
        controller_cls = InheritingController if inherited else TrainController
        controller_kwargs["failure_policy"] = PolicyAdapter(
            self.run_config.failure_config, self._policy
        )
        actor: Any = ray.remote(**options)(controller_cls)  # an actor class: untyped in Ray
        controller = actor.remote(**controller_kwargs)
        self._controller = controller
        if self._aborted.is_set():  # abort() came before the controller existed
            controller.abort.remote()
        on_main_thread = threading.current_thread() is threading.main_thread()
        caller_sigint = signal.getsignal(signal.SIGINT)
        if on_main_thread:
            self._register_sigint_handler(controller)
        try:
            ray.get(controller.run.remote())
            return ray.get(controller.get_result.remote())
        except ray.exceptions.RayActorError:
            if self._aborted.is_set():  # abort() ends the controller's process
                raise RunAborted("the run was aborted") from None
            raise
        finally:
            # The run is over. Ray's SIGINT handler would keep the controller's handle, and
            # with it the controller's process, until the next fit; and a Ctrl-C in the
            # caller's program after it would end that program with exit 0.
            self._controller = None
            if on_main_thread:
                signal.signal(signal.SIGINT, caller_sigint)
            ray.kill(controller)
