"""Which rows of a streamed epoch each rank reads, as a pure function of the rows left.

A streamed split is read from its files, never held whole, so a rank must read a few long
runs of the epoch's order, not one batch of every step as ``EpochSchedule`` cuts a cached
set (every rank would then read every file). Here each rank gets one contiguous block of
the order: rank 0 the first rows, rank 1 the next, and so on. Its batches are consecutive
pieces of its block, of the sizes ``step_slices`` gives, so every rank has the same number
of steps, none of them empty, and every row is in one batch.

What is left of an epoch after some steps is no longer one run but the tail of each rank's
block: a list of intervals of the epoch's order. ``StreamSchedule`` keeps that list in its
state (Lightning's loader protocol), so a restore on any world size cuts the same rows left
into its own blocks: nothing of the epoch is repeated or skipped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from raytrain.data.loaders import rows_trained

logger = logging.getLogger(__name__)

Interval = tuple[int, int]  # [start, stop) of the epoch's order


def span(intervals: Sequence[Interval]) -> int:
    """How many rows ``intervals`` hold."""
    return sum(hi - lo for lo, hi in intervals)


def take(intervals: Sequence[Interval], start: int, stop: int) -> list[Interval]:
    """Rows ``start`` to ``stop`` of the sequence ``intervals`` make, as intervals."""
    out: list[Interval] = []
    seen = 0
    for lo, hi in intervals:
        a, b = max(start - seen, 0), min(stop - seen, hi - lo)
        if a < b:
            out.append((lo + a, lo + b))
        seen += hi - lo
        if seen >= stop:
            break
    return out


def rank_share(total: int, batch_size: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """Rank ``rank``'s share of ``total`` rows cut as ``step_slices`` cuts them, in closed
    form: (its first row when the ranks' shares are laid end to end, its steps, the rows
    of its last step). Every step but the last gives each rank ``batch_size`` rows; the
    last splits what is left evenly (it is at least one row a rank). A test pins it to
    ``step_slices``; the lists that function builds cost seconds at 10 million rows."""
    per_step = world_size * batch_size
    steps = max(1, math.ceil(total / per_step))
    if steps > 1 and total - (steps - 1) * per_step < world_size:
        steps -= 1
    rest = total - (steps - 1) * per_step
    cut = rank * rest // world_size
    last = (rank + 1) * rest // world_size - cut
    return rank * (steps - 1) * batch_size + cut, steps, last


def rank_block(
    left: Sequence[Interval], batch_size: int, world_size: int, rank: int
) -> tuple[list[Interval], list[int]]:
    """Rank ``rank``'s block of the rows ``left`` and its batch sizes.

    Invariant: the blocks of ranks 0..world_size-1 are consecutive pieces of ``left`` that
    together are all of it, and every rank has the same number of batches, each with at
    least one row (``left`` must hold at least ``world_size`` rows)."""
    start, steps, last = rank_share(span(left), batch_size, world_size, rank)
    sizes = [batch_size] * (steps - 1) + [last]
    return take(left, start, start + (steps - 1) * batch_size + last), sizes


def rows_left(
    left: Sequence[Interval], batch_size: int, world_size: int, steps: int
) -> list[Interval]:
    """The rows of ``left`` not yet trained once ``world_size`` ranks took ``steps`` steps
    of their blocks: the tail of each rank's block, in rank order."""
    out: list[Interval] = []
    for rank in range(world_size):
        start, total, last = rank_share(span(left), batch_size, world_size, rank)
        length = (total - 1) * batch_size + last
        done = min(steps, total - 1) * batch_size + (last if steps >= total else 0)
        out += take(left, start + done, start + length)
    return out


class StreamSchedule:
    """This rank's share of an epoch of ``num_rows`` rows of a streamed set: its block of
    the epoch's order (as intervals) and its batch sizes.

    It keeps Lightning's resumable-loader protocol: its state is the epoch, Lightning's count
    of the epoch's batches begun (``position``, kept by ``LoaderPosition``), and the rows of
    the epoch not yet trained (``left``). Restored mid-epoch, it cuts those rows into blocks
    for the current world size, and its length is the steps already done plus those left,
    as Lightning counts them. If fewer rows are left than there are workers (only after a
    restore on more workers, near an epoch's end), they are skipped, with a warning, as
    ``EpochSchedule`` does: no rank may have an empty batch.
    """

    def __init__(self, num_rows: int, batch_size: int, *, rank: int, world_size: int):
        self._rows = num_rows
        self._batch_size = batch_size
        self._rank = rank
        self._world = world_size
        self.epoch = 0
        self.position = 0
        # a restore mid-epoch: (epoch, rows it had left, steps done), for that epoch's pass
        self._start: tuple[int, list[Interval], int] | None = None

    @property
    def num_rows(self) -> int:
        """The rows of an epoch."""
        return self._rows

    def _run(self) -> tuple[list[Interval], int]:
        """The rows left when this epoch's pass began, and the steps done then."""
        if self._start is not None and self._start[0] == self.epoch:
            return self._start[1], self._start[2]
        return [(0, self._rows)], 0

    def plan(self) -> tuple[int, list[Interval], list[int]]:
        """(steps already done in this epoch, this rank's block, its batch sizes)."""
        left, done = self._run()
        if span(left) == 0:
            return done, [], []
        if span(left) < self._world:  # only after a resize: too few rows to give each a batch
            logger.warning("%d rows left in epoch %d for %d workers: skipped", span(left),
                           self.epoch, self._world)
            return done, [], []
        block, sizes = rank_block(left, self._batch_size, self._world, self._rank)
        return done, block, sizes

    def __len__(self) -> int:
        done, _, sizes = self.plan()
        return done + len(sizes)

    def state_dict(self) -> dict[str, object]:
        """Where training is in the data: saved in every Lightning checkpoint."""
        left, done = self._run()
        if span(left) >= self._world:
            left = rows_left(left, self._batch_size, self._world, max(self.position - done, 0))
        else:
            left = []  # the pass skipped them
        return {"epoch": self.epoch, "steps": self.position, "left": [list(i) for i in left]}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Resume from ``state``: the next pass over its epoch reads only the rows it had
        left, cut for this world size."""
        self.epoch = int(state["epoch"])  # type: ignore[call-overload]
        self.position = int(state["steps"])  # type: ignore[call-overload]
        if "left" in state:
            left = [(int(lo), int(hi)) for lo, hi in state["left"]]  # type: ignore[attr-defined]
        else:  # saved by another loader: the split took another path since
            logger.warning("the checkpoint's data position is another loader's: the epoch "
                           "resumes exact in count, not in which rows")
            left = [(min(rows_trained(state, self._rows, self._batch_size), self._rows),
                     self._rows)]
        self._start = (self.epoch, left, self.position)
