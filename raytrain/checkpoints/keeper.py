"""The in-memory training state (``checkpoint.memory_every_n_steps``): the keeper that holds
it outside the training processes, and which state a restart resumes from.

``StateKeeper`` is a Ray actor the driver starts for the run (``start_keeper``), so it
outlives any worker group: a worker's or a node's loss (where the keeper was elsewhere)
leaves it, and a restarted group resumes from it; the driver's loss takes it down, and a
rerun resumes from storage. It holds one state, rank 0's latest, as bytes it owns (an
actor call's argument, copied into the keeper: an object owned by a dead worker would be
lost with it), replacing the one before.

A group's rank 0 ``open``s the keeper when it starts: that fences off the sends of the
group before (one may still be on its way from a dead rank 0) and returns the step of
the state held, which every rank then fetches by its step. No Lightning, no torch: the
driver imports this module.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raytrain.spec import JobSpec


def keeps_memory_state(spec: JobSpec) -> bool:
    """Whether rank 0 keeps its state in memory: ``checkpoint.memory_every_n_steps`` not
    off (the default ``auto`` included), under DDP (rank 0 holds the whole state). FSDP
    and model parallelism resume from storage only for now: each rank holds a shard."""
    from raytrain.worker.strategy import rank_zero_holds_state

    return spec.checkpoint.memory_every_n_steps is not None and rank_zero_holds_state(spec)


def memory_is_newer(memory_step: int | None, storage_step: int | None) -> bool:
    """Whether a restart resumes from the state in memory (at ``memory_step``, None: none
    held) rather than from the checkpoint in storage (at ``storage_step``, None: none):
    only when it is strictly newer (at the same step, storage's is the one committed)."""
    if memory_step is None:
        return False
    return storage_step is None or memory_step > storage_step


@dataclass(frozen=True)
class Held:
    """The state a keeper holds: its step, its bytes (a Lightning checkpoint's), and the
    group (``open``'s token) that sent it."""

    step: int
    data: bytes
    token: int


class StateKeeper:
    """Holds rank 0's latest training state (see the module docstring). Plain Python, run
    as a Ray actor by ``start_keeper``."""

    def __init__(self) -> None:
        # a random first token: a keeper Ray restarted (its node lost) never takes a send
        # meant for the one before, whose tokens counted from another start
        self._token = secrets.randbits(48)
        self._held: Held | None = None
        self.refused = 0  # sends from a fenced-off group

    def open(self) -> tuple[int, int | None]:
        """A new group starts: from now on only sends with the token returned are taken.
        Returns (token, step of the state held, None: none)."""
        self._token += 1
        return self._token, self._held.step if self._held is not None else None

    def put(self, token: int, step: int, data: bytes) -> bool:
        """Keep ``data``, the state at ``step``, in place of the one held; refused (False)
        from a group fenced off by a later ``open``."""
        if token != self._token:
            self.refused += 1
            return False
        self._held = Held(step, bytes(data), token)
        return True

    def drop(self) -> None:
        """Let go of the state held and fence off every send of the group now open (a loss
        spike: the rollback goes back to storage, not to the state just before the spike,
        and a send already on its way must not put one back)."""
        self._token += 1
        self._held = None

    def get(self, step: int) -> bytes | None:
        """The state held, if it is the one at ``step`` (None: another, or none)."""
        held = self._held
        return held.data if held is not None and held.step == step else None

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


def stop_keeper(keeper: Any) -> None:
    """End the keeper with the run: its handle sits in the trainer's worker config."""
    import ray

    if keeper is not None:
        ray.kill(keeper)
