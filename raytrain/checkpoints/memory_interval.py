"""``checkpoint.memory_every_n_steps: auto``: how often the training state is kept in
memory, chosen so that keeping it costs at most ``BUDGET`` of training.

Keeping the state costs a snapshot (the state copied off the live tensors, on the training
thread) and a send (serialised and handed to the keeper, on a background thread: its CPU
time, which training shares; the wait for the keeper's answer is free). Under DDP the
snapshot is also written to the node's memory (``worker.local_state``: a background
thread's CPU, no other process), which a process's loss leaves and a node's does not.

- **Sent only** (FSDP, model parallelism): every step where snapshot and send cost at most
  5% of a step; else the smallest interval that keeps them within 5%.
- **Written on the node and sent** (DDP): the node's copy every step where snapshot and
  write cost at most ``NODE_BUDGET`` (4.5%) of a step, else the smallest interval within it;
  the keeper's copy every ``send_steps``, at most ``SEND_BUDGET`` (0.5%) by the sender's
  accounting. The keeper's copy gets the small share because its true cost is larger than
  that accounting says: on 2 cores, a send every step cost digits ~45% of its throughput
  where the accounting said 17-20% (the keeper's process and Ray's object store compete
  with training); and because it is for the rarer fault, a node's loss.

So a fault loses as few steps as the budget allows. Pure functions and a small
accumulator, no Lightning, no Ray: unit-tested on the rule; rank 0 alone runs it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# The share of training time the in-memory state may cost; with a node's copy, split.
BUDGET = 0.05
NODE_BUDGET = 0.045
SEND_BUDGET = BUDGET - NODE_BUDGET
# The longest interval chosen, in steps: a state so costly is kept rarely, not never.
MOST_MEMORY_STEPS = 10_000


def memory_steps(keep_s: float, step_s: float, budget: float = BUDGET) -> int:
    """The interval, in optimizer steps, between keeps of the state: the smallest N with
    ``keep_s / (N * step_s) <= budget``. Invariant: 1 where a keep costs at most
    ``budget`` of a step, longer as keeps cost more or steps less, at most
    ``MOST_MEMORY_STEPS``."""
    if keep_s <= 0:
        return 1
    if step_s <= 0 or not math.isfinite(step_s) or not math.isfinite(keep_s):
        return MOST_MEMORY_STEPS
    return max(1, min(MOST_MEMORY_STEPS, math.ceil(keep_s / (budget * step_s) - 1e-9)))


@dataclass
class MemoryChoice:
    """One choice of the interval and the figures that made it, for the log line; or, with
    ``as_set``, a number the spec set and what it costs. ``write_s`` is the node's copy's
    write (None: no node copy, the state is sent only); with one, ``steps`` is the node
    copy's interval and ``send_steps`` the keeper's."""

    steps: int
    snapshot_s: float
    send_s: float
    step_s: float
    as_set: bool = False
    write_s: float | None = None
    send_steps: int | None = None

    @property
    def cost(self) -> float:
        """The share of training the choice spends keeping the state (by the keeping
        threads' own accounting)."""
        if self.step_s <= 0:
            return math.inf
        if self.write_s is None:
            return (self.snapshot_s + self.send_s) / (self.steps * self.step_s)
        node = (self.snapshot_s + self.write_s) / (self.steps * self.step_s)
        return node + self.send_s / ((self.send_steps or self.steps) * self.step_s)

    def describe(self) -> str:
        bound = "as set" if self.as_set else f"at most {100 * BUDGET:.0f}%"
        if self.write_s is None:
            return (
                f"in-memory state every {self.steps} step(s): keeping it costs "
                f"{self.snapshot_s + self.send_s:.3g} s (snapshot {self.snapshot_s:.3g} "
                f"s, send {self.send_s:.3g} s), a step {self.step_s:.3g} s: "
                f"{100 * self.cost:.2g}% of training ({bound})"
            )
        return (
            f"in-memory state on the node every {self.steps} step(s), in the keeper "
            f"every {self.send_steps} step(s): snapshot {self.snapshot_s:.3g} s, write "
            f"{self.write_s:.3g} s, send {self.send_s:.3g} s, a step {self.step_s:.3g} s: "
            f"{100 * self.cost:.2g}% of training ({bound})"
        )


class MemoryCost:
    """The figures ``memory_steps`` needs, measured as the run goes: each keep's snapshot
    time and send (CPU) time, and the step time (training between steps, less the
    snapshots). Each is the median of its last ``window`` samples: a step that ran a
    validation or a checkpoint is not a step's cost."""

    def __init__(self, window: int = 20):
        self.window = window
        self._snapshots: list[float] = []
        self._sends: list[float] = []
        self._writes: list[float] = []
        self._steps: list[float] = []

    def snapshot(self, seconds: float) -> None:
        self._snapshots = [*self._snapshots, seconds][-self.window :]

    def sent(self, seconds: float) -> None:
        self._sends = [*self._sends, seconds][-self.window :]

    def written(self, seconds: float) -> None:
        self._writes = [*self._writes, seconds][-self.window :]

    def stepped(self, seconds: float) -> None:
        if seconds > 0:
            self._steps = [*self._steps, seconds][-self.window :]

    def choose(self, as_set: int | None = None) -> MemoryChoice | None:
        """The interval for the figures so far (None until a keep and a step are known);
        with ``as_set``, that interval and what it costs. With a node's copy measured
        (``written``), the two intervals of the module docstring; ``as_set`` then sets the
        node copy's, and the keeper's is chosen as under ``auto``."""
        if not self._snapshots or not self._sends or not self._steps:
            return None
        snap = statistics.median(self._snapshots)
        send = statistics.median(self._sends)
        step = statistics.median(self._steps)
        if not self._writes:  # sent only
            if as_set is not None:
                return MemoryChoice(as_set, snap, send, step, as_set=True)
            return MemoryChoice(memory_steps(snap + send, step), snap, send, step)
        write = statistics.median(self._writes)
        node = as_set if as_set is not None else memory_steps(snap + write, step, NODE_BUDGET)
        # the keeper's copy: at most SEND_BUDGET, and never more often than the node's
        sends = max(node, memory_steps(send, step, SEND_BUDGET))
        return MemoryChoice(node, snap, send, step, as_set is not None, write, sends)

    @property
    def measured(self) -> int:
        """How many sends the figures hold (at most ``window``)."""
        return len(self._sends)
