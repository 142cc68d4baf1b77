"""Warm worker processes: a cluster raytrain starts keeps idle Ray workers with torch,
Lightning and raytrain's worker modules already imported, so that a run's controller and
workers (and a replacement after a failure, and a sweep trial's group) start in a process
that is ready instead of a new one that imports for seconds first.

Two parts. ``PRELOAD``, given to the raylet as ``preload_python_modules``, makes every
Python worker it starts import those modules before it takes work. ``WarmPool`` keeps
``target`` such processes idle and free for any job: Ray prestarts some for the first
driver only, and a finished job's processes exit with it. Only modules every run imports
are preloaded, never the user's: a run always imports the user's current code.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from raytrain._compat.ray_core import RAY_TRAIN_WORKER_MODULE, RayletPool

logger = logging.getLogger(__name__)

# What every raytrain worker imports before its first step (measured: 2.7 s of Lightning
# alone on this project's machine). Ray Train's worker actor module is here too: each
# worker actor's class brings it in.
PRELOAD = (
    "torch",
    "torch.distributed",
    "lightning.pytorch",
    "ray.train.torch",
    RAY_TRAIN_WORKER_MODULE,
    "raytrain.worker.callbacks",
    "raytrain.worker.loop",
    "raytrain.worker.warm_ready",  # last: the process is ready once it is imported
)

# The raylet's system config key for ``PRELOAD`` (Ray 2.60: a list of module names).
PRELOAD_CONFIG = {"preload_python_modules": list(PRELOAD)}

# How long the raylet keeps a prestarted process though it is idle beyond its soft limit;
# the pool asks again long before.
KEEP_ALIVE_S = 3600
# Processes the pool lets import at once once a run may use the cluster (see
# ``WarmPool.top_up``); while ``fill`` waits, before any run can, one per core.
IMPORTING_AT_ONCE = 1
# How often the pool counts the raylet's idle processes.
CHECK_EVERY_S = 1.0


class WarmPool:
    """Keeps ``target`` idle worker processes on the raylet at ``address`` (its node
    manager's ``host:port``), from a daemon thread until ``stop``.

    Counting and starting are separate RPCs, and processes still starting are not counted
    yet; the raylet starts no more than its startup concurrency at once, so the pool never
    overshoots by more than that."""

    def __init__(
        self, address: str, target: int, every_s: float = CHECK_EVERY_S, marks: Path | None = None
    ):
        self.target = target
        self.marks = marks
        self.at_once = IMPORTING_AT_ONCE
        self._every_s = every_s
        self._raylet = RayletPool(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-warm-pool", daemon=True)

    def start(self) -> WarmPool:
        self._thread.start()
        return self

    def top_up(self) -> int:
        """One round: start what is missing; the count of idle processes found.

        Only while no actor runs on the node: a refill beside a run's training took its
        cores (measured on 2 cores: the compute-bound step 163 ms against 120 ms), so the
        pool refills between runs; its ``target`` leaves spares a run does not take, for a
        replacement group after a failure. With ``marks``, one process imports at a time:
        a run that starts while the pool refills then competes with one import, not with
        a pool's worth (7 at once put such a run's first step at 38 s); ``at_once`` of
        them, raised by ``fill`` while no run can be there yet."""
        workers = self._raylet.workers()
        idle = set(workers.idle)
        missing = 0 if workers.actors else self.target - len(idle)
        if missing > 0 and self.marks is not None:
            missing = min(missing, self.at_once - len(idle - self._marked()))
        if missing > 0:
            self._raylet.prestart(missing, KEEP_ALIVE_S)
        return len(idle)

    def _marked(self) -> set[int]:
        if self.marks is None:
            return set()
        return {int(p.name) for p in self.marks.iterdir() if p.name.isdigit()}

    def fill(self, timeout_s: float) -> bool:
        """The first filling, before the cluster is announced (no run can use it yet):
        ``wait_ready`` with one process importing per core instead of one in all. On this
        project's 2-core machine ``raytrain up`` waited 55.6 s for 9 processes imported
        one at a time."""
        self.at_once = max(IMPORTING_AT_ONCE, os.cpu_count() or 1)
        try:
            return self.wait_ready(timeout_s)
        finally:
            self.at_once = IMPORTING_AT_ONCE

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until ``target`` idle processes have imported every preloaded module (each
        has marked itself in ``marks``, see ``worker.warm_ready``), at most ``timeout_s``;
        whether they have. A process is registered, and counted idle, before it imports."""
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if len(self._marked() & set(self._raylet.workers().idle)) >= self.target:
                    return True
            except Exception as err:  # the raylet is still starting
                logger.debug("warm pool: %s", err)
            self._stop.wait(0.5)
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.top_up()
            except Exception as err:  # the cluster is going away, or busy: try again
                logger.debug("warm pool: %s", err)
            self._stop.wait(self._every_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._raylet.close()


def local_raylet_address() -> str:
    """This driver's node's raylet (``host:port``), from the connected Ray."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    return f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"
