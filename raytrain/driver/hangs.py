"""The ranks' hang reports on the driver (``worker.hang_watchdog`` finds a hung rank).

``Hangs`` is a listener of every rank's ``HangReport``: each is said on stderr in one line
with its stacks file, the stacks go to MLflow (``hangs/{attempt}/rank{r}.txt``), and the
hang's summary (``hang_summary``: the ranks not in a collective first) goes to
the run's tag ``raytrain.hang`` and to ``on_hang`` (the status record, whose next restart
gives it as the reason). The attempt's ranks end their processes themselves; the failure
policy restarts it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from raytrain.checkpoints.layout import HANGS
from raytrain.contract import HangReport, RunListener


class Hangs(RunListener):
    """The listener of hang reports (see the module docstring). ``read_text`` reads a
    stacks file (None: not there); the others are MLflow's and the status record's."""

    def __init__(
        self,
        read_text: Callable[[str], str | None],
        log_text: Callable[[str, str], None],
        set_tags: Callable[[dict[str, str]], None],
        on_hang: Callable[[str], None] = lambda summary: None,
        stream: TextIO | None = None,
    ):
        self._read, self._log, self._tag, self._on_hang = read_text, log_text, set_tags, on_hang
        self._stream = stream
        self.reports: list[HangReport] = []  # the latest hang's, one per rank
        self.summaries: list[str] = []  # every hang's summary, in order

    def on_hang(self, report: HangReport) -> None:
        if self.reports and self.reports[0].attempt != report.attempt:
            self.reports = []  # a hang of a later attempt
        self.reports.append(report)
        print(
            f"raytrain: hang: {report.describe()}; stacks: {report.stacks}",
            file=self._stream or sys.stderr,
        )
        summary = hang_summary(self.reports)
        if len(self.reports) == 1:
            self.summaries.append(summary)
        else:
            self.summaries[-1] = summary
        self._on_hang(summary)
        self._tag({"raytrain.hang": summary})
        text = self._read(report.stacks)
        if text is not None:
            self._log(text, f"{HANGS}/{report.attempt}/rank{report.rank}.txt")


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
