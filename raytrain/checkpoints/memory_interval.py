"""``checkpoint.memory_every_n_steps: auto``: how often rank 0 keeps its training state in
memory, chosen so that keeping it costs at most ``BUDGET`` of training.

Keeping the state costs the sender a snapshot (the state copied off the live tensors, on
the training thread) and a send (serialised and handed to the keeper, on a background
thread: its CPU time, which training shares; the wait for the keeper's answer is free).
Every step is kept where that costs at most 5% of a step; else the smallest interval that
keeps the cost within 5%, so that a fault loses as few steps as the budget allows. Pure
functions and a small accumulator, no Lightning, no Ray: unit-tested on the rule; rank 0
alone runs it (it alone keeps the state).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# The share of training time the in-memory state may cost.
BUDGET = 0.05
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
    ``as_set``, a number the spec set and what it costs."""

    steps: int
    snapshot_s: float
    send_s: float
    step_s: float
    as_set: bool = False

    @property
    def cost(self) -> float:
        """The share of training the choice spends keeping the state."""
        keep = self.snapshot_s + self.send_s
        return keep / (self.steps * self.step_s) if self.step_s > 0 else math.inf

    def describe(self) -> str:
        bound = "as set" if self.as_set else f"at most {100 * BUDGET:.0f}%"
        return (f"in-memory state every {self.steps} step(s): keeping it costs "
                f"{self.snapshot_s + self.send_s:.3g} s (snapshot {self.snapshot_s:.3g} s, "
                f"send {self.send_s:.3g} s), a step {self.step_s:.3g} s: "
                f"{100 * self.cost:.2g}% of training ({bound})")  # fmt: skip


class MemoryCost:
    """The figures ``memory_steps`` needs, measured as the run goes: each keep's snapshot
    time and send (CPU) time, and the step time (training between steps, less the
    snapshots). Each is the median of its last ``window`` samples: a step that ran a
    validation or a checkpoint is not a step's cost."""

    def __init__(self, window: int = 20):
        self.window = window
        self._snapshots: list[float] = []
        self._sends: list[float] = []
        self._steps: list[float] = []

    def snapshot(self, seconds: float) -> None:
        self._snapshots = [*self._snapshots, seconds][-self.window :]

    def sent(self, seconds: float) -> None:
        self._sends = [*self._sends, seconds][-self.window :]

    def stepped(self, seconds: float) -> None:
        if seconds > 0:
            self._steps = [*self._steps, seconds][-self.window :]

    def choose(self, as_set: int | None = None) -> MemoryChoice | None:
        """The interval for the figures so far (None until a keep and a step are known);
        with ``as_set``, that interval and what it costs."""
        if not self._snapshots or not self._sends or not self._steps:
            return None
        snap = statistics.median(self._snapshots)
        send = statistics.median(self._sends)
        step = statistics.median(self._steps)
        if as_set is not None:
            return MemoryChoice(as_set, snap, send, step, as_set=True)
        return MemoryChoice(memory_steps(snap + send, step), snap, send, step)

    @property
    def measured(self) -> int:
        """How many sends the figures hold (at most ``window``)."""
        return len(self._sends)
