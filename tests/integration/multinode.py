"""A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head and worker
nodes, each its own raylet and object store), and a thread that acts on a node when the
training workers say so (remove it, drain it, add one)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# Each worker node holds one training slot: the spec asks for this resource per worker, so
# workers land only on worker nodes, one each, and the head keeps the driver's work.
SLOT = "trainer_slot"
WORKER_RESOURCES = {"CPU": 1, SLOT: 1}


@contextmanager
def multinode_cluster() -> Iterator[Any]:
    """A head (2 CPUs, no slot) that this process is connected to; ``fresh_slot_nodes``
    gives it worker nodes. Ray Train's preemption watcher is on (an embedded cluster turns it
    off in this process's environment) and polls every 0.5 s; a worker group that cannot
    be placed is given up after 3 s.

    A process connects to one cluster at a time: the session's embedded Ray, if running,
    is stopped for the block and started again after it, with the environment it had."""
    import ray
    from ray.cluster_utils import Cluster

    from raytrain.driver import ray_runtime

    embedded_cpus = None
    if ray.is_initialized():
        embedded_cpus = int(ray.cluster_resources().get("CPU", 0)) or None
        ray.shutdown()
        ray_runtime._started_env = None
    try:
        with pytest.MonkeyPatch.context() as env:
            env.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", raising=False)
            env.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
            # After a node dies, Ray Train's view of the cluster lags up to 20 s: a restart
            # at the old size waits this long for a placement group it cannot get, then
            # tries again (the wait covers the placement group only, which takes well under
            # a second here when the nodes have room; the workers' start is not in it).
            env.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "3")
            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
            try:
                ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
                cluster.wait_for_nodes()
                yield cluster
            finally:
                ray.shutdown()
                cluster.shutdown()
    finally:
        if embedded_cpus:
            ray_runtime.start_local(embedded_cpus)


def add_slot_node(cluster: Any) -> Any:
    return cluster.add_node(num_cpus=1, resources={SLOT: 1}, object_store_memory=80 * 2**20)


def fresh_slot_nodes(cluster: Any, count: int) -> None:
    """Replace every worker node of ``cluster`` with ``count`` new ones of a slot each, and
    wait until the GCS sees exactly those alive: a test then starts on whole nodes, whatever
    the test before it removed or drained. Cheaper than a new cluster (a node is a raylet;
    a cluster is also a GCS, a head and this process's connection to it)."""
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node, allow_graceful=True)
    for _ in range(count):
        add_slot_node(cluster)
    cluster.wait_for_nodes()


def node_by_id(cluster: Any, node_id: str) -> Any:
    return next(n for n in cluster.list_all_nodes() if n.node_id == node_id)


def read_events(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / "events.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return sorted((json.loads(x) for x in lines if x.strip()), key=lambda e: e["at"])


def run_with_actions(
    out_dir: Path,
    run: Callable[[], Any],
    actions: dict[str, Callable[[dict[str, Any]], None]],
    timeout: float = 600,
) -> tuple[Any, list[str]]:
    """Call ``run`` in a thread while this (main) thread waits for each event named in
    ``actions`` (appended to ``out_dir/events.jsonl`` by the model) and calls its action
    with it, once: adding a node to a ``Cluster`` needs the main thread. Returns ``run``'s
    value and the names of the actions done, in order; raises ``run``'s error."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = run()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    done: list[str] = []
    deadline = time.monotonic() + timeout
    while thread.is_alive() and time.monotonic() < deadline:
        for event in read_events(out_dir):
            name = event["event"]
            if name in actions and name not in done:
                done.append(name)
                actions[name](event)
        thread.join(timeout=0.1)
    thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if "error" in outcome:
        raise outcome["error"]
    assert "value" in outcome, f"the run did not end within {timeout} s"
    return outcome["value"], done
