"""Ray (non-Train) internals raytrain relies on, written for Ray 2.60 (``versions.SUPPORTED``).

- ``upload_matchers``: ``ray._private.runtime_env.packaging`` (``PathSpec``,
  ``get_excludes_from_ignore_files``), ``ray._private.ray_constants``
  (``get_runtime_env_default_excludes``, ``RAY_RUNTIME_ENV_IGNORE_GITIGNORE``) and its
  vendored ``pathspec``'s ``GitWildMatchPattern.escape``: Ray's own
  rules for what a working-dir upload leaves out, so ``submit`` names exactly what Ray drops.
- ``NOISY_LOGGERS``: loggers of Ray internals that print a line per upload or per auth.
- ``arrow_to_numpy``: ``ray.data._internal.arrow_block.ArrowBlockAccessor``'s numpy batch
  format, what ``map_batches(batch_format="numpy")`` hands a function (a fixed-size list
  column as a 2-D array), so ``data.preprocess`` gets the same batch on raytrain's own
  readers as in Ray Data.
- ``RayletPool``: a raylet's ``NodeManagerService`` over ``ray._private.grpc_utils``'
  ``init_grpc_channel`` (token auth included): ``GetNodeStats`` to count the idle worker
  processes no job has taken yet (``CoreWorkerStats.job_id`` nil) and those holding an
  actor (``actor_id`` not nil), and
  ``PrestartWorkers`` (no job id, a keep-alive) to start more. Ray keeps such a pool only
  for its first driver; nothing public starts one later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

NOISY_LOGGERS = {
    "working_dir": "ray._private.runtime_env.working_dir",
    "data_progress": "ray.data._internal.progress",
    "authentication": "ray._private.authentication",
}


@dataclass(frozen=True)
class UploadMatchers:
    """Ray's working-dir upload rules: its default excludes, its gitignore-style matcher,
    the per-folder ignore files it reads, and whether it reads ``.gitignore``."""

    default_excludes: list[str]
    path_spec: Any  # pathspec.PathSpec (Ray's vendored copy)
    excludes_from_ignore_files: Any  # (folder, include_gitignore, logger) -> [matcher]
    reads_gitignore: bool
    escape: Any  # str -> a pattern matching that path literally


def upload_matchers() -> UploadMatchers:
    """Ray's upload rules, as the running Ray applies them."""
    from ray._private import ray_constants
    from ray._private.runtime_env.packaging import PathSpec, get_excludes_from_ignore_files
    from ray._private.thirdparty.pathspec.patterns.gitwildmatch import GitWildMatchPattern

    flag = os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0")
    return UploadMatchers(
        default_excludes=list(ray_constants.get_runtime_env_default_excludes()),
        path_spec=PathSpec,
        excludes_from_ignore_files=get_excludes_from_ignore_files,
        reads_gitignore=flag != "1",
        escape=GitWildMatchPattern.escape,
    )


def arrow_to_numpy(table: Any) -> dict[str, Any]:
    """An Arrow table as Ray Data's numpy batch: a dict of arrays by column."""
    from ray.data._internal.arrow_block import ArrowBlockAccessor

    return ArrowBlockAccessor(table).to_batch_format("numpy")


RAY_TRAIN_WORKER_MODULE = "ray.train.v2._internal.execution.worker_group.worker"

# A worker process no job has taken reports the nil job id, one without an actor the nil
# actor id: all bits set.
_NIL_JOB_ID = b"\xff\xff\xff\xff"
_NIL_ACTOR_ID = b"\xff" * 16


@dataclass(frozen=True)
class NodeWorkers:
    """A raylet's Python workers: ``idle`` (process ids no job has taken yet) and
    ``actors`` (how many processes hold an actor)."""

    idle: list[int]
    actors: int


class RayletPool:
    """The idle worker processes of one raylet (``host:port``, its node manager) that any
    job may take: counted, and started on request."""

    def __init__(self, address: str):
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

        # generated protobuf modules: no stubs, their members are untyped
        self._common: Any = common_pb2
        self._messages: Any = node_manager_pb2
        self.address = address
        self._channel = init_grpc_channel(address)
        self._stub = node_manager_pb2_grpc.NodeManagerServiceStub(self._channel)

    def workers(self, timeout: float = 5.0) -> NodeWorkers:
        """The raylet's Python worker processes: the idle ones no job has taken, and how
        many hold an actor (a run's controller, workers and helpers)."""
        common = self._common
        reply = self._stub.GetNodeStats(self._messages.GetNodeStatsRequest(), timeout=timeout)
        python = [
            w
            for w in reply.core_workers_stats
            if w.worker_type == common.WORKER and w.language == common.PYTHON
        ]
        return NodeWorkers(
            idle=[w.pid for w in python if w.job_id == _NIL_JOB_ID],
            actors=sum(1 for w in python if w.actor_id and w.actor_id != _NIL_ACTOR_ID),
        )

    def prestart(self, count: int, keep_alive_s: int, timeout: float = 5.0) -> None:
        """Ask the raylet to start ``count`` more (it starts at most its startup
        concurrency at once); each is kept ``keep_alive_s`` though idle."""
        request = self._messages.PrestartWorkersRequest(
            language=self._common.PYTHON, keep_alive_duration_secs=keep_alive_s, num_workers=count
        )
        self._stub.PrestartWorkers(request, timeout=timeout)

    def close(self) -> None:
        self._channel.close()


def refresh_auth_mode() -> None:
    """Make this process's Ray see the ``RAY_AUTH_MODE`` now in its environment."""
    from ray._raylet import Config  # type: ignore[attr-defined]  # Cython: no stub

    Config.initialize("")
