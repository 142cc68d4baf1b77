"""``raytrain run --chaos MTBF`` (``failure.chaos``): faults injected into a user's own run,
to see what they cost before a cluster does it for real.

A ``ChaosMonkey`` actor (0 CPUs, on the driver's node, like the event sink) SIGKILLs one
training worker at a time, at exponentially distributed times with mean ``mtbf_s`` seconds
of training, from a seeded generator. It counts only time in which a whole worker group
trains: the clock starts when every rank of a group has registered (``worker.chaos_marks``
registers each at its start), and a group that changed (a restart for another reason, a
resize) draws its next time anew, which an exponential law allows. A worker on another node
is killed by a task pinned to that node.

What a fault cost comes from the ranks themselves: rank 0 tells the monkey each step it
finishes, so a kill knows the last step trained; the new group's rank 0 registers with the
step it restored, then tells its first step's time. A fault is then: when, which rank, the
steps trained again (last step before the kill less the step restored), and the kill to the
next step. An injected fault is retried without counting against ``failure.max_failures``
(``ChaosClaim``: the failure policy claims one kill per failure). The summary
(``chaos_summary``) adds the overhead against the same run without faults, estimated as the
recovery times plus the retrained steps at the run's step time.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import statistics
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.actor import ActorHandle

# How often the monkey's thread looks at the group while it waits.
_POLL_S = 0.05


@dataclass
class Fault:
    """One injected fault, as the ranks' marks fill it in."""

    at: float  # when the worker was killed (Unix time)
    rank: int
    pid: int
    last_step: int | None  # the last step the group finished before the kill
    restored_step: int | None = None  # the step the next group started from
    first_step_at: float | None = None  # when the next group finished its first step

    @property
    def lost_steps(self) -> int | None:
        if self.last_step is None or self.restored_step is None:
            return None
        return max(0, self.last_step - self.restored_step)

    @property
    def recovery_s(self) -> float | None:
        return None if self.first_step_at is None else max(0.0, self.first_step_at - self.at)


class ChaosMonkey:
    """The fault injector (see the module docstring); a Ray actor's class."""

    def __init__(self, mtbf_s: float, seed: int, node_id: str):
        self.mtbf_s = mtbf_s
        self.rng = random.Random(seed)
        self.node_id = node_id
        self.faults: list[Fault] = []
        self._lock = threading.Lock()
        self._group: dict[int, tuple[int, str]] = {}  # rank -> (pid, node), this group's
        self._world = 0
        self._killed: set[int] = set()
        self._changed = 0  # bumped at each registration: a group that changed redraws
        self._last_step: int | None = None
        self._unclaimed = 0
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="raytrain-chaos", daemon=True).start()

    # -- the ranks' marks ------------------------------------------------------------------

    def register(self, rank: int, pid: int, node: str, world_size: int, step: int) -> None:
        """A rank of a (new) group starts training at ``step``."""
        with self._lock:
            if rank in self._group and self._group[rank][0] != pid:
                self._group = {}  # a new group: its ranks register anew
            self._group[rank], self._world = (pid, node), world_size
            self._changed += 1
            if rank == 0:
                self._last_step = step
                pending = self._pending()
                if pending is not None and pending.restored_step is None:
                    pending.restored_step = step

    def step(self, step: int) -> None:
        """Rank 0 finished optimizer step ``step``."""
        with self._lock:
            self._last_step = step

    def first_step(self, step: int, at: float) -> None:
        """Rank 0 of a new group finished its first step at ``at``."""
        with self._lock:
            self._last_step = step
            pending = self._pending()
            if pending is not None and pending.first_step_at is None:
                pending.first_step_at = at

    def _pending(self) -> Fault | None:
        return self.faults[-1] if self.faults else None

    # -- the failure policy and the driver -------------------------------------------------

    def claim(self) -> bool:
        """Whether a worker-group failure is an injected one (each kill is claimed once)."""
        with self._lock:
            if self._unclaimed:
                self._unclaimed -= 1
                return True
            return False

    def ledger(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dataclasses.asdict(fault) for fault in self.faults]

    def stop(self) -> None:
        self._stop.set()

    # -- the injector ----------------------------------------------------------------------

    def _eligible(self) -> int | None:
        """The registration count of a whole group that trains and was not hit, else None."""
        with self._lock:
            whole = self._world and len(self._group) == self._world
            hit = {pid for pid, _ in self._group.values()} & self._killed
            return self._changed if whole and not hit else None

    def _run(self) -> None:
        while not self._stop.is_set():
            seen = self._eligible()
            if seen is None:
                self._stop.wait(_POLL_S)
                continue
            due = time.monotonic() + self.rng.expovariate(1.0 / self.mtbf_s)
            while not self._stop.is_set() and time.monotonic() < due:
                if self._eligible() != seen:
                    break  # the group changed: draw anew
                self._stop.wait(min(_POLL_S, max(0.0, due - time.monotonic())))
            else:
                if not self._stop.is_set():
                    self._kill()

    def _kill(self) -> None:
        with self._lock:
            rank = self.rng.choice(sorted(self._group))
            pid, node = self._group[rank]
            self._killed.add(pid)
            self.faults.append(Fault(at=time.time(), rank=rank, pid=pid, last_step=self._last_step))
            self._unclaimed += 1
        try:
            if node == self.node_id:
                os.kill(pid, signal.SIGKILL)
            else:
                _kill_on(node, pid)
        except (ProcessLookupError, PermissionError):  # it ended meanwhile: a fault anyway
            pass


def _kill_on(node: str, pid: int) -> None:
    """SIGKILL ``pid`` on another node of the cluster, by a task pinned there."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def kill(pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    task = ray.remote(num_cpus=0)(kill).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
    )
    ray.get(task.remote(pid), timeout=30)


def start_chaos(mtbf_s: float, seed: int) -> Any:
    """The run's ``ChaosMonkey`` actor, on this node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    actor = ray.remote(num_cpus=0)(ChaosMonkey)
    return actor.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)
    ).remote(mtbf_s, seed, here)


def stop_chaos(monkey: Any) -> list[Fault]:
    """Stop injecting; the faults injected, as the ranks' marks left them."""
    import ray

    try:
        ledger = ray.get(monkey.ledger.remote(), timeout=30)
    finally:
        ray.kill(monkey)
    return [Fault(**entry) for entry in ledger]


class ChaosClaim:
    """What the failure policy asks, in Ray Train's controller: whether this failure was
    injected (it is then retried, not counted). Picklable: it travels with the policy."""

    def __init__(self, monkey: ActorHandle):
        self.monkey = monkey

    def __call__(self) -> bool:
        import ray

        try:
            return bool(ray.get(self.monkey.claim.remote(), timeout=10))
        except Exception:  # no answer: the failure counts, as any other would
            return False


@dataclass(frozen=True)
class ChaosSummary:
    """The faults of a run and what they cost."""

    faults: list[Fault]
    mtbf_s: float
    seed: int
    wall_s: float  # the run's time, faults and all
    overhead_s: float  # recovery times plus retrained steps, at the run's step time
    step_s: float | None

    @property
    def overhead(self) -> float:
        """The overhead against the same run without faults (its time, estimated)."""
        clean = self.wall_s - self.overhead_s
        return self.overhead_s / clean if clean > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        """The figures MLflow gets (``chaos/...``)."""
        lost = [f.lost_steps for f in self.faults if f.lost_steps is not None]
        recovery = [f.recovery_s for f in self.faults if f.recovery_s is not None]
        out = {
            "chaos/faults": float(len(self.faults)),
            "chaos/overhead": self.overhead,
            "chaos/overhead_s": self.overhead_s,
        }
        if lost:
            out["chaos/lost_steps_median"] = float(statistics.median(lost))
            out["chaos/lost_steps_max"] = float(max(lost))
        if recovery:
            out["chaos/recovery_s_median"] = statistics.median(recovery)
        return out

    def as_dict(self) -> dict[str, Any]:
        """The summary as ``FitResult.chaos`` holds it (JSON): each fault with what it cost,
        the figures of ``metrics``, and the table's ``lines``."""
        faults = [
            {**dataclasses.asdict(f), "lost_steps": f.lost_steps, "recovery_s": f.recovery_s}
            for f in self.faults
        ]
        return {
            "faults": faults,
            "mtbf_s": self.mtbf_s,
            "seed": self.seed,
            "wall_s": self.wall_s,
            "step_s": self.step_s,
            **self.metrics(),
            "lines": self.lines(),
        }

    def lines(self) -> list[str]:
        """The fault table as the summary prints it."""
        out = [
            f"chaos: {len(self.faults)} fault(s) injected (MTBF {self.mtbf_s:g} s of "
            f"training, seed {self.seed})"
        ]
        if self.faults:
            out.append("    #  rank  last step  restored  lost steps  kill -> next step")

        def cell(value: Any, fmt: str = "{}") -> str:
            return "-" if value is None else fmt.format(value)

        for n, fault in enumerate(self.faults, 1):
            out.append(
                f"  {n:>3}  {fault.rank:>4}  {cell(fault.last_step):>9}  "
                f"{cell(fault.restored_step):>8}  {cell(fault.lost_steps):>10}  "
                f"{cell(fault.recovery_s, '{:.1f} s'):>17}"
            )
        out.append(
            f"  overhead: {self.overhead_s:.1f} s of {self.wall_s:.1f} s, "
            f"{100 * self.overhead:.0f}% over the same run without faults (estimated: "
            "recovery times plus retrained steps)"
        )
        return out


def chaos_summary(
    faults: list[Fault], mtbf_s: float, seed: int, wall_s: float, steps: int
) -> ChaosSummary:
    """What ``faults`` cost a run of ``wall_s`` seconds that ended at step ``steps``: the
    step time is the run's time less the recoveries over every step trained (retrained
    ones too); the overhead is the recoveries plus the retrained steps at that time."""
    recovery = sum(f.recovery_s or 0.0 for f in faults)
    lost = sum(f.lost_steps or 0 for f in faults)
    trained = steps + lost
    step_s = (wall_s - recovery) / trained if trained > 0 and wall_s > recovery else None
    overhead = recovery + lost * (step_s or 0.0)
    return ChaosSummary(faults, mtbf_s, seed, wall_s, overhead, step_s)
