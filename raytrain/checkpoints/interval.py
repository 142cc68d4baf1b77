"""``checkpoint.every_n_steps: auto``: the step interval between checkpoints, chosen from
what a checkpoint costs and how often the run fails (Young's rule, as refined by Daly).

A checkpoint every T seconds of training costs C/T of the run in blocked saves; a failure
loses on average T/2 of work. Over a mean time between failures M the total waste
C/T + T/(2M) is least at T = sqrt(2 C M) (Young, 1974; Daly, 2006, to first order). The
interval in steps is T over the step time. Pure functions and a small accumulator, no
Lightning, no Ray: unit-tested on the formula, and rank 0 alone runs it (the ranks take
its answer by a broadcast, so every rank checkpoints at the same steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Before the run has failed, and without ``failure.mtbf_s``: the mean time between
# failures assumed, a day (a large GPU cluster's published figures are hours per job of
# thousands of GPUs; a small job's, days). A measured failure replaces it.
ASSUMED_MTBF_S = 86_400.0
# The first checkpoint of an ``auto`` run comes after this many steps: it measures C.
FIRST_AUTO_STEPS = 10
# The longest interval chosen, in steps: epochs still checkpoint by ``every_n_epochs``.
MOST_AUTO_STEPS = 100_000


def young_daly_steps(save_s: float, mtbf_s: float, step_s: float) -> int:
    """The checkpoint interval in optimizer steps: sqrt(2 * save_s * mtbf_s) seconds of
    training, over ``step_s`` a step. Invariant: at least 1 and at most
    ``MOST_AUTO_STEPS``; longer when saves are slower, shorter when failures come more
    often (and when steps are slower)."""
    if step_s <= 0 or not math.isfinite(step_s):
        return MOST_AUTO_STEPS
    seconds = math.sqrt(2.0 * max(save_s, 0.0) * max(mtbf_s, 0.0))
    return max(1, min(MOST_AUTO_STEPS, round(seconds / step_s)))


@dataclass
class IntervalChoice:
    """One choice of the interval and the figures that made it, for the log line."""

    steps: int
    save_s: float
    mtbf_s: float
    mtbf_from: str  # "measured", "failure.mtbf_s" or "assumed"
    step_s: float

    def describe(self) -> str:
        seconds = math.sqrt(2.0 * self.save_s * self.mtbf_s)
        return (
            f"checkpoint every {self.steps} step(s): a save blocks {self.save_s:.3g} s, "
            f"MTBF {self.mtbf_s:.4g} s ({self.mtbf_from}), a step {self.step_s:.3g} s; "
            f"sqrt(2 x save x MTBF) = {seconds:.3g} s"
        )


class AutoInterval:
    """The figures ``young_daly_steps`` needs, measured as the run goes: each checkpoint's
    blocking time, and the training time between checkpoints (less their own time) over
    the steps it covered. Each is the mean of its last ``window`` samples."""

    def __init__(self, mtbf_s: float | None, mtbf_from: str = "failure.mtbf_s", window: int = 5):
        self.mtbf_s, self.mtbf_from = mtbf_s, mtbf_from
        self.window = window
        self._saves: list[float] = []
        self._steps: list[float] = []

    def saved(self, blocked_s: float) -> None:
        self._saves = [*self._saves, blocked_s][-self.window :]

    def trained(self, steps: int, seconds: float) -> None:
        if steps > 0 and seconds > 0:
            self._steps = [*self._steps, seconds / steps][-self.window :]

    def choose(self, measured_mtbf_s: float | None) -> IntervalChoice | None:
        """The interval for the figures so far (None until a save and a step are known):
        a measured MTBF first, else the spec's (``mtbf_from`` names it: ``failure.mtbf_s``
        or a chaos run's ``failure.chaos.mtbf_s``), else ``ASSUMED_MTBF_S``."""
        if not self._saves or not self._steps:
            return None
        if measured_mtbf_s is not None:
            mtbf, source = measured_mtbf_s, "measured"
        elif self.mtbf_s is not None:
            mtbf, source = self.mtbf_s, self.mtbf_from
        else:
            mtbf, source = ASSUMED_MTBF_S, "assumed"
        save = sum(self._saves) / len(self._saves)
        step = sum(self._steps) / len(self._steps)
        return IntervalChoice(young_daly_steps(save, mtbf, step), save, mtbf, source, step)
