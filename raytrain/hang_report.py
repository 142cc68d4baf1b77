"""What a hung rank is, how long each part of training may go without a finished batch,
and the report a rank sends when it stops finishing them (``failure.hang_timeout_s``).

The rank's side is ``worker.hang_watchdog``; the driver's is ``driver.hangs``. This module
needs neither Lightning nor Ray, so both sides (and a unit test) share it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

# The key of a rank's hang report in the run's events: its value is a ``HangReport``'s fields.
HANG_KEY = "_hang"
# The run folder's folder of hang reports, one folder per attempt that hung (``{token}``,
# the attempt's start as rank 0 gave it), one stacks file per rank; also their folder in
# MLflow's artifacts.
HANGS = "hangs"
# The floor of the automatic step timeout, and its multiple of the median step time.
AUTO_FLOOR_S = 60.0
AUTO_STEPS = 20
# Where a rank is between batch ends. ``starting``: from the start of training, of an
# epoch or of a validation to its first batch (compiling, a loader's workers starting);
# ``saving``: a batch's, validation's or epoch's end hooks (reports, checkpoint saves).
Phase = Literal["starting", "data", "forward", "backward", "optimizer", "saving", "validation"]


@dataclass(frozen=True)
class HangLimits:
    """``failure``'s hang settings: ``timeout_s`` None is automatic, 0 is off."""

    timeout_s: float | None
    first_step_s: float
    checkpoint_s: float

    @property
    def enabled(self) -> bool:
        return self.timeout_s != 0


def step_timeout(limits: HangLimits, step_times: Sequence[float]) -> float:
    """How long a batch may take: ``timeout_s``, or max(``AUTO_FLOOR_S``, ``AUTO_STEPS`` x
    the median of ``step_times``); before a step was timed, the first step's allowance."""
    if limits.timeout_s:
        return limits.timeout_s
    if not step_times:
        return max(limits.first_step_s, AUTO_FLOOR_S)
    return max(AUTO_FLOOR_S, AUTO_STEPS * statistics.median(step_times))


def allowance(phase: Phase, limits: HangLimits, step_times: Sequence[float]) -> float:
    """How long ``phase`` may go on without a batch finishing. Invariant: never below the
    step timeout; ``starting`` gets at least ``first_step_s``, ``saving`` at least
    ``checkpoint_s``: the first batch and a checkpoint's save are not hangs because they
    are slow."""
    base = step_timeout(limits, step_times)
    if phase == "starting":
        return max(base, limits.first_step_s)
    if phase == "saving":
        return max(base, limits.checkpoint_s)
    return base


# Files of torch's collectives: a rank whose main thread is in one waits for the others.
_COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py", "torch/distributed/c10d")


def collective_of(phase: str, files: Sequence[str], world_size: int) -> str | None:
    """The collective a rank waits in, or None: a call into torch.distributed in the thread
    that trains (``files``: its frames' file names, outermost first), or, in a world of more
    than one, the backward pass: DDP waits there for the gradients' all-reduce, and
    backward compute does not take 20 steps' time."""
    for name in reversed(files):
        if any(mark in name.replace("\\", "/") for mark in _COLLECTIVE_FILES):
            return "a torch.distributed collective"
    if phase == "backward" and world_size > 1:
        return "the gradients' all-reduce (backward)"
    return None


@dataclass(frozen=True)
class HangReport:
    """One rank's report of a hang: where it was and for how long, and its stacks' file."""

    rank: int
    world_size: int
    node: str
    pid: int
    step: int
    phase: str
    idle_s: float
    allowed_s: float
    collective: str | None  # the collective it waits in; None: it is not in one
    attempt: str  # the attempt's token: its folder of stacks files
    stacks: str  # the stacks file: {run}/hangs/{attempt}/rank{r}.txt
    at: float  # when it was found (Unix time)

    def to_event(self) -> dict[str, Any]:
        return {HANG_KEY: asdict(self)}

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> HangReport:
        return cls(**event[HANG_KEY])

    def describe(self) -> str:
        where = f"in {self.collective}" if self.collective else "not in a collective"
        return (
            f"rank {self.rank} (node {self.node}) {where}, in {self.phase} at step "
            f"{self.step}: no batch finished for {self.idle_s:.0f} s (allowed "
            f"{self.allowed_s:.0f} s)"
        )


def hang_summary(reports: Sequence[HangReport]) -> str:
    """One line for a hang from the ranks' reports: the ranks not in a collective (the
    likely cause) first, then how many waited in one."""
    if not reports:
        return ""
    first = min(reports, key=lambda r: r.at)
    ranked = sorted(reports, key=lambda r: r.rank)
    culprits = [f"rank {r.rank} in {r.phase}" for r in ranked if r.collective is None]
    waiting = [str(r.rank) for r in ranked if r.collective is not None]
    parts = [f"hang at step {first.step}: no batch finished for {first.idle_s:.0f} s"]
    if culprits:
        parts.append(f"not in a collective: {', '.join(culprits)}")
    if waiting:
        parts.append(f"waiting in a collective: rank {', '.join(waiting)}")
    reported = len(reports)
    if reported < first.world_size:
        parts.append(f"{first.world_size - reported} rank(s) sent no stacks")
    return "; ".join(parts)
