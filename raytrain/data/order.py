"""The order rows are trained in, as pure functions of a seed, an epoch, the world size
and the rows left: every rank computes the same, every row is trained once per epoch, and
a restore on any world size resumes exactly. Nothing here imports the rest of ``data/``:
the loaders, the streams and the mix build on it.

A cached (indexed) split: ``epoch_order`` permutes its rows per epoch and ``step_slices``
cuts the order into steps, each rank a slice of every step (``EpochSchedule``).

A streamed split:
Which rows of a streamed epoch each rank reads, as a pure function of the rows left.

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

import itertools
import logging
import math
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

Interval = tuple[int, int]  # [start, stop) of the epoch's order


def epoch_seed(seed: int, epoch: int, rank: int = 0) -> int:
    """A seed for (seed, epoch, rank) that every process computes alike (``hash`` of a str
    differs between processes)."""
    return zlib.crc32(f"{seed}/{epoch}/{rank}".encode())


def epoch_order(n: int, seed: int | None, epoch: int) -> np.ndarray:
    """An epoch's order of ``n`` rows: a permutation seeded by (seed, epoch), the same in
    every process; no seed: the rows' own order."""
    import numpy as np

    if seed is None:
        return np.arange(n)
    return np.random.default_rng(epoch_seed(seed, epoch)).permutation(n)


def step_slices(num_rows: int, batch_size: int, world_size: int) -> list[list[tuple[int, int]]]:
    """How an epoch's ``num_rows`` (in order) become steps: for each step, each rank's
    ``(start, stop)`` slice of that order.

    A step takes the next ``world_size * batch_size`` rows and splits them between the ranks
    as evenly as possible; the last step takes what is left. Every row is in exactly one
    batch, and every rank has the same number of steps with at least one row in each (a
    remainder smaller than ``world_size`` joins the step before), which DDP needs: the same
    number of all-reduces on every rank, and every rank at each metric sync.
    """
    if num_rows < world_size:
        raise ValueError(f"{num_rows} rows cannot give each of {world_size} workers a batch")
    per_step = world_size * batch_size
    steps = max(1, math.ceil(num_rows / per_step))
    if steps > 1 and num_rows - (steps - 1) * per_step < world_size:
        steps -= 1
    out = []
    for step in range(steps):
        lo = step * per_step
        hi = num_rows if step == steps - 1 else lo + per_step
        cuts = [lo + r * (hi - lo) // world_size for r in range(world_size + 1)]
        out.append(list(itertools.pairwise(cuts)))
    return out


def rows_trained(state: Mapping[str, Any], num_rows: int, batch_size: int) -> int:
    """How many rows of its epoch a loader state says were trained, whichever loader saved
    it: a cached set's (``rows``), a streamed Parquet split's (``left``: the rows not
    trained) or a Ray Data shard's (``steps`` of ``world_size`` batches). A split that
    took another path since the checkpoint (a cluster whose object store now holds it)
    resumes from this count: exact in count, not in which rows."""
    if "rows" in state:
        return int(state["rows"])
    if "left" in state:
        return num_rows - sum(int(hi) - int(lo) for lo, hi in state["left"])
    return min(num_rows, int(state["steps"]) * batch_size * int(state.get("world_size", 1)))


class ResumableSchedule:
    """What ``EpochSchedule`` and ``StreamSchedule`` share: a rank's share of each epoch of
    ``num_rows`` rows, in steps of ``batch_size`` rows per rank, resumable by Lightning's
    loader protocol (``state_dict``/``load_state_dict``: each keeps its own position).

    ``epoch`` and ``position`` (Lightning's count of the epoch's batches begun, kept by
    ``LoaderPosition``) say where training is. Restored mid-epoch, a pass is the rest of the
    epoch cut for the current world size (which may differ from the one that saved it:
    elastic runs), and its length the steps already done plus those left, as Lightning's
    restored loop counts them. Fewer rows left than ranks (only after a resize, near an
    epoch's end) are skipped with a warning: no rank may have an empty batch."""

    def __init__(self, num_rows: int, batch_size: int, *, rank: int, world_size: int):
        self._rows = num_rows
        self._batch_size = batch_size
        self._rank = rank
        self._world = world_size
        self.epoch = 0
        self.position = 0

    @property
    def num_rows(self) -> int:
        """The rows of an epoch."""
        return self._rows

    def _steps(self) -> tuple[int, int]:
        """This epoch's (steps already done, steps left in the pass)."""
        raise NotImplementedError

    def __len__(self) -> int:
        done, left = self._steps()
        return done + left

    def _fits(self, left: int) -> bool:
        """Whether ``left`` rows give every rank a batch; not (a warning) when fewer rows
        than ranks are left: they are skipped."""
        if 0 < left < self._world:
            logger.warning(
                "%d rows left in epoch %d for %d workers: skipped", left, self.epoch, self._world
            )
        return left >= self._world

    @staticmethod
    def _another_loaders() -> None:
        logger.warning(
            "the checkpoint's data position is another loader's: the epoch "
            "resumes exact in count, not in which rows"
        )


class EpochSchedule(ResumableSchedule):
    """This rank's share of an epoch of ``num_rows`` indexed rows, as lists of row indices,
    one pass per epoch: what ``CachedBatches`` takes from an Arrow table, and what a
    user's map-style dataset is sampled by (``worker.user_data``).

    The epoch's order is a permutation of all rows seeded by (seed, epoch), the same on every
    rank (no seed: the stored order). ``step_slices`` cuts it into steps and each step
    into one batch per rank. So every row is seen exactly once per epoch, by one rank; every
    epoch reshuffles globally; and a rerun of an epoch repeats it exactly.

    It is resumable (Lightning's ``state_dict``/``load_state_dict`` loader protocol): its
    state is the epoch and how far into that epoch's order training got, in rows. Restored
    mid-epoch, it yields the rest of that epoch's order, cut into steps for the current
    world size (which may differ from the one that saved it: elastic runs), and its length
    is the steps already done plus those left, as Lightning's restored loop counts them.
    """

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        shuffle_seed: int | None = None,
    ):
        super().__init__(num_rows, batch_size, rank=rank, world_size=world_size)
        self._seed = shuffle_seed
        # A mid-epoch restore: (epoch, steps done, rows of its order done) until it is used.
        self._resume: tuple[int, int, int] | None = None
        # The pass under way: its epoch and schedule.
        self._pass: tuple[int, tuple[int, int, list[list[tuple[int, int]]]]] | None = None

    def _schedule(self) -> tuple[int, int, list[list[tuple[int, int]]]]:
        """This epoch's (steps already done, first row, steps left as slices of the order)."""
        if self._pass is not None and self._pass[0] == self.epoch:
            return self._pass[1]
        n = self._rows
        done, start = 0, 0
        if self._resume is not None and self._resume[0] == self.epoch:
            _, done, start = self._resume
        left = n - start
        if not self._fits(left):
            return done, start if left == 0 else n, []
        steps = step_slices(left, self._batch_size, self._world)
        return done, start, [[(lo + start, hi + start) for lo, hi in step] for step in steps]

    def _steps(self) -> tuple[int, int]:
        done, _, steps = self._schedule()
        return done, len(steps)

    def order(self) -> np.ndarray:
        """The current epoch's order of all rows (the same on every rank)."""
        return epoch_order(self._rows, self._seed, self.epoch)

    def rows_done(self) -> int:
        """How many rows of this epoch's order the first ``position`` steps cover."""
        done, start, steps = self._schedule()
        if self.position <= done:
            return start
        return steps[min(self.position - done, len(steps)) - 1][-1][1]

    def state_dict(self) -> dict[str, int]:
        """Where training is in the data: saved in every Lightning checkpoint."""
        return {"epoch": self.epoch, "steps": self.position, "rows": self.rows_done()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from ``state``: the next pass over its epoch starts at the row it reached."""
        self.epoch = int(state["epoch"])
        if "rows" not in state or "world_size" in state:  # a streamed split's, Ray Data's
            self._another_loaders()
        rows = rows_trained(state, self._rows, self._batch_size)
        self._resume = (self.epoch, int(state["steps"]), rows)
        self.position = int(state["steps"])

    def index_batches(self) -> Iterator[Any]:
        """This pass's batches for this rank, each as an array of row indices."""
        order = self.order()
        self._pass = None
        schedule = self._schedule()
        self._pass, self._resume = (self.epoch, schedule), None  # later passes: whole epochs
        for step in schedule[2]:
            lo, hi = step[self._rank]
            yield order[lo:hi]


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


class StreamSchedule(ResumableSchedule):
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
        super().__init__(num_rows, batch_size, rank=rank, world_size=world_size)
        # a restore mid-epoch: (epoch, rows it had left, steps done), for that epoch's pass
        self._start: tuple[int, list[Interval], int] | None = None

    def _run(self) -> tuple[list[Interval], int]:
        """The rows left when this epoch's pass began, and the steps done then."""
        if self._start is not None and self._start[0] == self.epoch:
            return self._start[1], self._start[2]
        return [(0, self._rows)], 0

    def plan(self) -> tuple[int, list[Interval], list[int]]:
        """(steps already done in this epoch, this rank's block, its batch sizes)."""
        left, done = self._run()
        if not self._fits(span(left)):
            return done, [], []
        block, sizes = rank_block(left, self._batch_size, self._world, self._rank)
        return done, block, sizes

    def _steps(self) -> tuple[int, int]:
        done, _, sizes = self.plan()
        return done, len(sizes)

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
            self._another_loaders()
            left = [
                (min(rows_trained(state, self._rows, self._batch_size), self._rows), self._rows)
            ]
        self._start = (self.epoch, left, self.position)
