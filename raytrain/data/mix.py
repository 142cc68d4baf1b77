"""A train set mixed from several sources by weight, exact on resume at any world size.

An epoch of a mix is ``epoch_rows`` positions (``data.epoch_rows``; unset, the sources'
rows together). Each source gets its quota of them, its weight's share rounded by largest
remainder, so the shares are exact to a row in every epoch; which position is whose is a
permutation seeded by (seed, epoch) (``labels``). The k-th position of source j in epoch e
takes row ``e * quota_j + k`` of that source's own endless sequence: its rows in its own
order (seeded by (seed, source, pass)), pass after pass. So a source smaller than its quota
starts over in a new order, and a larger one continues next epoch where it stopped.

The positions are cut into ranks' blocks and resumed exactly as a streamed split's are
(``StreamSchedule``). A rank reads, per source, the rows its block needs in order (a
cached source takes them from its table, a streamed one reads its windows, one at a time
on the training thread: no read-ahead, unlike a streamed split) and interleaves them by
the labels. The labels of an epoch are held by every rank: a byte a row of ``epoch_rows``
(100 MB for 100 million; 4 bytes past 256 sources; the spec bounds them to 1 GiB), and
``rows_seen`` scans them. The rows each source gave so far, over all ranks, follow from the
labels and the rows the epoch has left (``rows_seen``), so rank 0 reports them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from raytrain.contract import MixedSet
from raytrain.data.order import Interval, StreamSchedule, epoch_seed
from raytrain.data.parquet_stream import EpochLayout, WindowReader, cut_batches
from raytrain.spec.data import label_bytes

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

    from raytrain.spec import StorageSpec

CHUNK = 8192  # positions interleaved at a time


def quotas(weights: Sequence[float], total: int) -> list[int]:
    """``total`` split by ``weights``: each share rounded down, the rows left going to the
    largest remainders (ties: the earlier source). Invariant: they sum to ``total`` and each
    is within one row of its exact share; weights for which it cannot hold (none, one not
    finite and positive) are a ``ValueError``. The weights are scaled by the largest first,
    so their sum cannot overflow."""
    if not weights or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"mix weights must be finite and positive, got {list(weights)}")
    top = max(weights)
    scaled = [w / top for w in weights]
    exact = [w / sum(scaled) * total for w in scaled]
    out = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda j: (out[j] - exact[j], j))
    for j in by_remainder[: total - sum(out)]:
        out[j] += 1
    if sum(out) != total or any(abs(q - x) >= 1 for q, x in zip(out, exact, strict=True)):
        raise ValueError(f"the quotas {out} of weights {list(weights)} do not split {total} rows")
    return out


class SourceRows(Protocol):
    """One source of a mix: rows of its order in one of its passes."""

    def rows(self, turn: int, lo: int, hi: int) -> pa.Table:
        """Rows ``lo`` to ``hi`` of the source's order in pass ``turn``, an Arrow table."""
        ...


class CachedRows:
    """A cached source: its rows taken from its table, in a permutation per pass."""

    def __init__(self, table: pa.Table, seed: int | None):
        self._table, self._seed = table, seed
        self._order: tuple[int, Any] | None = None

    def rows(self, turn: int, lo: int, hi: int) -> pa.Table:
        import numpy as np

        if self._order is None or self._order[0] != turn:
            n = self._table.num_rows
            order = np.arange(n)
            if self._seed is not None:
                order = np.random.default_rng(epoch_seed(self._seed, turn)).permutation(n)
            self._order = (turn, order)
        return self._table.take(self._order[1][lo:hi])


class StreamedRows:
    """A streamed source: its rows read window by window (``EpochLayout`` per pass)."""

    def __init__(self, reader: WindowReader, seed: int | None, window_rows: int):
        self._reader, self._seed, self._window_rows = reader, seed, window_rows
        self._layout: tuple[int, EpochLayout] | None = None
        self._window: tuple[int, int, Any] | None = None  # (turn, window, its table)

    def rows(self, turn: int, lo: int, hi: int) -> pa.Table:
        import pyarrow as pa

        if self._layout is None or self._layout[0] != turn:
            layout = EpochLayout(self._reader.set.counts, self._seed, turn, self._window_rows)
            self._layout = (turn, layout)
        layout = self._layout[1]
        parts = []
        for window, a, b in layout.pieces([(lo, hi)]):
            if self._window is None or self._window[:2] != (turn, window):
                self._window = (turn, window, self._reader.read(layout, window))
            parts.append(self._window[2].slice(a, b - a))
        return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


class MixedStream(StreamSchedule):
    """This rank's batches of a mixed train set (see the module docstring), as dicts of
    tensors (or tuples in ``tuple_columns`` order). Resumable: see ``StreamSchedule``."""

    def __init__(
        self,
        mix: MixedSet,
        sources: Sequence[SourceRows],
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        shuffle_seed: int | None = None,
        tuple_columns: list[str] | None = None,
    ):
        super().__init__(mix.epoch_rows, batch_size, rank=rank, world_size=world_size)
        self._mix, self._sources = mix, list(sources)
        self._seed = shuffle_seed
        self._tuple = tuple_columns
        self.quotas = quotas(mix.weights, mix.epoch_rows)
        self._labels: tuple[int, Any] | None = None

    def labels(self, epoch: int) -> np.ndarray:
        """Which source each position of ``epoch`` takes its row from."""
        import numpy as np

        if self._labels is None or self._labels[0] != epoch:
            kind = np.uint8 if label_bytes(len(self.quotas)) == 1 else np.int32
            labels = np.repeat(np.arange(len(self.quotas), dtype=kind), self.quotas)
            rng = np.random.default_rng(epoch_seed(self._seed or 0, epoch))
            self._labels = (epoch, rng.permutation(labels))
        return self._labels[1]

    def _source_rows(self, j: int, start: int, n: int) -> Iterator[Any]:
        """Rows ``start`` to ``start + n`` of source j's endless sequence."""
        size = self._mix.rows[j]
        while n > 0:
            turn, at = divmod(start, size)
            take = min(n, size - at)
            yield self._sources[j].rows(turn, at, at + take)
            start, n = start + take, n - take

    def tables(self, block: Sequence[Interval], epoch: int) -> Iterator[Any]:
        """The rows of ``block`` (positions of ``epoch``) as Arrow tables, in order."""
        import numpy as np
        import pyarrow as pa

        labels = self.labels(epoch)
        for lo, hi in block:
            # each source's next row: its rows of earlier epochs and earlier positions
            nxt = [
                epoch * q + int(np.count_nonzero(labels[:lo] == j))
                for j, q in enumerate(self.quotas)
            ]
            for a in range(lo, hi, CHUNK):
                chunk = labels[a : min(hi, a + CHUNK)]
                parts = []
                for j in range(len(self.quotas)):
                    n = int(np.count_nonzero(chunk == j))
                    parts += list(self._source_rows(j, nxt[j], n))
                    nxt[j] += n
                grouped = pa.concat_tables(parts)  # by source, each in position order
                order = np.argsort(chunk, kind="stable")
                where = np.empty_like(order)
                where[order] = np.arange(len(order))
                yield grouped.take(where)

    def __iter__(self) -> Iterator[Any]:
        # planned at the first batch, not when the iterator is made: Lightning makes it
        # before the epoch's hooks set the epoch (or a rollback its position)
        _, block, sizes = self.plan()
        yield from cut_batches(self.tables(block, self.epoch), sizes, self._tuple)

    def rows_seen(self) -> dict[str, int]:
        """The rows each source gave the run so far, over all ranks, by source name."""
        import numpy as np

        labels = self.labels(self.epoch)
        left: list[list[int]] = self.state_dict()["left"]  # type: ignore[assignment]
        out = {}
        for j, (name, q) in enumerate(zip(self._mix.names, self.quotas, strict=True)):
            pending = sum(int(np.count_nonzero(labels[lo:hi] == j)) for lo, hi in left)
            out[name] = self.epoch * q + q - pending
        return out


def mixed_loader(
    mix: MixedSet,
    options: StorageSpec | None,
    columns: list[str] | None,
    batch_size: int,
    *,
    rank: int,
    world_size: int,
    shuffle_seed: int | None,
    window_rows: int,
    tuple_columns: list[str] | None,
) -> MixedStream:
    """A rank's ``MixedStream``: each source's rows from the object store or its files,
    each shuffled by a seed of its own."""
    import pyarrow as pa
    import ray

    from raytrain import storage
    from raytrain.contract import CachedSet

    sources: list[SourceRows] = []
    for j, part in enumerate(mix.parts):
        seed = None if shuffle_seed is None else epoch_seed(shuffle_seed, -1, j + 1)
        if isinstance(part, CachedSet):
            table = pa.concat_tables(ray.get(part.refs))
            sources.append(CachedRows(table.select(columns) if columns else table, seed))
        else:
            fs, _ = storage.filesystem(part.uri, options)
            sources.append(StreamedRows(WindowReader(part, fs, columns), seed, window_rows))
    return MixedStream(
        mix,
        sources,
        batch_size,
        rank=rank,
        world_size=world_size,
        shuffle_seed=shuffle_seed,
        tuple_columns=tuple_columns,
    )
