"""The ranks' step timelines on the driver, and the straggler they show.

Every rank sends, per report window, the p50 and p90 of each part of its steps
(``worker.step_timeline``). ``Timelines`` keeps them by window and rank, logs them to
MLflow per rank (``timeline/rank{r}/{part}_p50_s``, ``_p90_s`` and ``_mean_s`` at the
window's step), and once every rank of a window has reported, compares their ``busy``
time (a rank's own work: data wait, forward, backward and the optimizer, less any wait in
a collective: the gradients' all-reduce, and those the step runs itself). Under DDP every
rank's step takes as long as the slowest one's, so the step time cannot tell them apart,
but the busy time can: the others wait for the straggler in ``comm_wait``.

A rank is a straggler when its busy p50 is above ``FACTOR`` times the median of the
others' for ``WINDOWS`` windows running (``straggler_in``, pure). It is named once on
stderr, in MLflow (``raytrain.straggler``), and through ``on_straggler`` (the status
record). ``summary()`` is every window, for the run's ``timeline.json`` artifact.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raytrain.contract import RunListener, TimelineWindow

FACTOR = 1.5
WINDOWS = 3


@dataclass(frozen=True)
class Straggler:
    rank: int
    node: str
    factor: float  # its busy time over the others' median, in the last window
    step: int  # the window's step where it was named

    def describe(self) -> str:
        return (
            f"rank {self.rank} on {self.node}: {self.factor:.1f}x the other ranks' "
            f"median busy time per step (since step {self.step})"
        )


def factors(busy: dict[int, float]) -> dict[int, float]:
    """Each rank's busy time over the median of the other ranks' (1.0 when alone)."""
    out = {}
    for rank, mine in busy.items():
        others = [v for r, v in busy.items() if r != rank]
        base = statistics.median(others) if others else mine
        out[rank] = mine / base if base > 0 else 1.0
    return out


def straggler_in(
    windows: list[dict[int, float]], factor: float = FACTOR, count: int = WINDOWS
) -> tuple[int, float] | None:
    """The rank whose busy time was above ``factor`` times the others' median in each of
    the last ``count`` complete windows (``windows``: rank -> busy p50, oldest first), with
    its factor in the last one; None if no rank was. A world of one has no straggler."""
    if len(windows) < count or any(len(w) < 2 for w in windows[-count:]):
        return None
    recent = [factors(w) for w in windows[-count:]]
    slow = set.intersection(*({r for r, f in w.items() if f > factor} for w in recent))
    if not slow:
        return None
    rank = max(slow, key=lambda r: recent[-1][r])
    return rank, recent[-1][rank]


class Timelines(RunListener):
    """The driver's listener of the ranks' timeline windows (see the module docstring)."""

    def __init__(
        self,
        log_metrics: Callable[[dict[str, float], int], None],
        set_tags: Callable[[dict[str, str]], None],
        on_straggler: Callable[[Straggler | None], None] = lambda s: None,
    ):
        self._log, self._tag, self._on_straggler = log_metrics, set_tags, on_straggler
        self.windows: dict[int, dict[int, TimelineWindow]] = {}  # step -> rank -> window
        self._judged: list[dict[int, float]] = []  # complete windows' busy p50 per rank
        self.straggler: Straggler | None = None
        self.named: list[Straggler] = []

    def on_timeline(self, event: TimelineWindow) -> None:
        step, rank = event.step, event.rank
        window = self.windows.setdefault(step, {})
        window[rank] = event
        parts = event.parts
        self._log(
            {
                f"timeline/rank{rank}/{part}_{q}_s": value
                for part, values in parts.items()
                for q, value in zip(("p50", "p90", "mean"), values, strict=False)
            },
            step,
        )
        if len(window) == event.world_size:
            self._judge(step, window)

    def _judge(self, step: int, window: dict[int, TimelineWindow]) -> None:
        busy = {r: float(e.parts["busy"][0]) for r, e in window.items() if "busy" in e.parts}
        self._judged.append(busy)
        found = straggler_in(self._judged)
        if found is None:
            if self.straggler is not None and factors(busy).get(self.straggler.rank, 0) <= FACTOR:
                self.straggler = None  # it caught up
                self._on_straggler(None)
            return
        rank, factor = found
        if self.straggler is None or self.straggler.rank != rank:
            node = window[rank].node
            self.straggler = Straggler(rank=rank, node=node, factor=factor, step=step)
            self.named.append(self.straggler)
            text = self.straggler.describe()
            print(f"raytrain: straggler: {text}", file=sys.stderr)
            self._tag({"raytrain.straggler": text})
        else:
            self.straggler = Straggler(rank, self.straggler.node, factor, self.straggler.step)
        self._on_straggler(self.straggler)

    def summary(self) -> dict[str, Any]:
        """Every window, rank by rank, and the stragglers named: ``timeline.json``."""
        return {
            "windows": [
                {
                    "step": step,
                    "ranks": {
                        str(r): {"node": e.node, "parts": dict(e.parts)}
                        for r, e in sorted(ranks.items())
                    },
                }
                for step, ranks in sorted(self.windows.items())
            ],
            "stragglers": [s.__dict__ for s in self.named],
        }
