"""The in-memory training state (``checkpoint.memory_every_n_steps``): the keeper that holds
it outside the training processes, and which state a restart resumes from.

``StateKeeper`` is a Ray actor the driver starts for the run (``start_keeper``), so it
outlives any worker group: a worker's or a node's loss (where the keeper was elsewhere)
leaves it, and a restarted group resumes from it; the driver's loss takes it down, and a
rerun resumes from storage. It holds one state, the latest complete one, as the files of
a Lightning checkpoint (relative path → bytes, owned by the keeper: an actor call's
argument is copied into it, where an object owned by a dead worker would be lost with
it), replacing the one before. Under DDP rank 0 sends the state whole (one part, one
file); under FSDP and model parallelism each node's first rank sends the files its node's
ranks wrote of one sharded checkpoint (one part per node), and a state is held once
every part of its step has come.

A group's rank 0 ``open``s the keeper when it starts: that fences off the sends of the
group before (one may still be on its way from a dead rank) and returns the step of the
state held, which each node then fetches by its step. No Lightning, no torch: the driver
imports this module.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from raytrain.spec import JobSpec


def keeps_memory_state(spec: JobSpec) -> bool:
    """Whether the training state is kept in memory: ``checkpoint.memory_every_n_steps``
    not off (the default ``auto`` included), under every strategy."""
    return spec.checkpoint.memory_every_n_steps is not None


def memory_is_newer(memory_step: int | None, storage_step: int | None) -> bool:
    """Whether a restart resumes from the state in memory (at ``memory_step``, None: none
    held) rather than from the checkpoint in storage (at ``storage_step``, None: none):
    only when it is strictly newer (at the same step, storage's is the one committed)."""
    if memory_step is None:
        return False
    return storage_step is None or memory_step > storage_step


Files = dict[str, bytes]  # a checkpoint's files: path relative to its folder → content


@dataclass(frozen=True)
class Held:
    """The state a keeper holds: its step, its files (a Lightning checkpoint's: every
    part's together), and the group (``open``'s token) that sent it."""

    step: int
    files: Files
    token: int


@dataclass(frozen=True)
class Opened:
    """What ``StateKeeper.open`` tells a new group: its token (only its sends are taken
    from now on), the step of the state held (None: none), and the keeper's key, a random
    number of its own that marks the node-local copies written in its time
    (``worker.local_state``): a later driver's keeper never resumes from them."""

    token: int
    step: int | None
    key: int


class StateKeeper:
    """Holds rank 0's latest training state (see the module docstring). Plain Python, run
    as a Ray actor by ``start_keeper``."""

    def __init__(self) -> None:
        # a random first token: a keeper Ray restarted (its node lost) never takes a send
        # meant for the one before, whose tokens counted from another start
        self._token = secrets.randbits(48)
        self.key = secrets.randbits(62)  # an int64 every rank can all-reduce
        self._held: Held | None = None
        self._pending: dict[int, Files] = {}  # the parts come so far of ``_pending_step``
        self._pending_step: int | None = None
        self.refused = 0  # sends from a fenced-off group

    def open(self) -> Opened:
        """A new group starts: from now on only sends with the token returned are taken."""
        self._token += 1
        return Opened(self._token, self._held.step if self._held is not None else None, self.key)

    def put(
        self, token: int, step: int, files: dict[str, Any], part: int = 0, parts: int = 1
    ) -> bool:
        """Take ``files`` (bytes, or buffers such as numpy arrays: held as bytes), part
        ``part`` of ``parts`` of the state at ``step``; once every part of ``step`` has
        come, that state is held in place of the one before (until then the one before is
        kept: a group lost mid-keep resumes from it). A part of a newer step drops the
        parts of an older one that never completed. Refused (False) from a group fenced
        off by a later ``open``."""
        if token != self._token:
            self.refused += 1
            return False
        if self._pending_step != step:
            self._pending, self._pending_step = {}, step
        self._pending[part] = {str(k): bytes(v) for k, v in files.items()}
        if len(self._pending) >= parts:
            merged: Files = {}
            for index in sorted(self._pending):
                merged.update(self._pending[index])
            self._held = Held(step, merged, token)
            self._pending, self._pending_step = {}, None
        return True

    def drop(self) -> None:
        """Let go of the state held and fence off every send of the group now open (a loss
        spike: the rollback goes back to storage, not to the state just before the spike,
        and a send already on its way must not put one back). It takes a new key too: the
        node copies written before the spike, on any node, are another keeper's from now on,
        never resumed from, and removed where a restore finds them."""
        self._token += 1
        self.key = secrets.randbits(62)
        self._held = None
        self._pending, self._pending_step = {}, None

    def get(self, step: int) -> Files | None:
        """The files of the state held, if it is the one at ``step`` (None: another, or
        none)."""
        held = self._held
        return held.files if held is not None and held.step == step else None

    def held_step(self) -> int | None:
        """The step of the state held (None: none), for tests and the bench."""
        return self._held.step if self._held is not None else None

    def ready(self) -> bool:
        """Returns once the actor runs."""
        return True


def start_keeper() -> Any:
    """Start the run's ``StateKeeper`` actor; returns its handle.

    It takes no CPU and runs on the driver's node, in a process of its own. The driver
    owns it, so the driver's loss ends it wherever it runs; on the driver's node no other
    loss does (a keeper on a worker's node went with it in the elastic multinode test, so
    the restart had nothing newer than storage to resume from). Lost anyway (its process
    killed), Ray starts it again, empty: that restart resumes from storage, and the next
    group keeps its state in the new keeper."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    actor = ray.remote(num_cpus=0, max_restarts=-1)(StateKeeper)
    strategy = NodeAffinitySchedulingStrategy(here, soft=True)
    return actor.options(scheduling_strategy=strategy).remote()


def stop_keeper(keeper: ActorHandle | None) -> None:
    """End the keeper with the run: its handle sits in the trainer's worker config."""
    import ray

    if keeper is not None:
        ray.kill(keeper)
