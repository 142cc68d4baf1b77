"""Where the node copies of the in-memory state live (``worker.local_state``), without torch:
the driver clears them on every node when a run's training ends, however it ends.

A copy is removed by a restart, a loss spike and a normal end of training; a run whose
training processes are killed and not restarted (it failed after ``max_failures``, a sweep
stopped its trial, ``raytrain stop``) would otherwise leave its slots in ``/dev/shm``: the
state's size in node memory twice, until a rerun of the same run folder (a clean-clone CI
left 9 runs' slots there).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile

SLOTS = 2


def keep_scratch_name(run_folder: str) -> str:
    """The node-local name of a run's keeps: one per run folder (the lease lets one driver
    at a time run it), so a group that starts clears what a lost one left, and two runs on
    one node never share it."""
    return "raytrain-keep-" + hashlib.sha256(run_folder.encode()).hexdigest()[:16]


def state_roots() -> list[str]:
    """Where a node-local state may be: the node's memory first, then the temporary
    directory (where ``/dev/shm`` has no room)."""
    return ["/dev/shm", tempfile.gettempdir()]


def slot_paths(root: str, scratch: str) -> list[str]:
    """The slots' files under ``root`` for the run whose keep folder is ``scratch``."""
    return [os.path.join(root, f"{scratch}.{slot}.state") for slot in range(SLOTS)]


def remove_state(path: str) -> None:
    """Remove a slot's file (gone already: nothing to do)."""
    with contextlib.suppress(OSError):
        os.remove(path)


def clear_slots(scratch: str) -> int:
    """Remove this node's slots of the run ``scratch`` names; returns how many there were."""
    found = 0
    for root in state_roots():
        for path in slot_paths(root, scratch):
            found += os.path.exists(path)
            remove_state(path)
    return found


def clear_on_every_node(scratch: str, timeout_s: float = 30) -> int:
    """Clear the run's slots on every live node of the cluster (a task of no CPU pinned to
    each); returns how many were removed. Waits at most ``timeout_s``: a node that does not
    answer keeps its slots until the run folder's next run."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(clear_slots)
    refs = [
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ).remote(scratch)
        for node in ray.nodes()
        if node.get("Alive")
    ]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    return sum(ray.get(done))
