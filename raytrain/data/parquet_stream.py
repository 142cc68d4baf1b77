"""A streamed Parquet split (or CSV, JSON Lines: ``text_blocks``) read by each rank itself:
its block of every epoch's order (``data.order``), row group by row group, with pyarrow,
reads running ahead in threads.

An epoch's order is a function of (seed, epoch) and the files' row-group counts alone, so
every rank plans the same order without talking to the others, and a restore on any world
size finds the rows it had left (``StreamSchedule``'s state):

1. The row groups are permuted (seeded by (seed, epoch); no seed: the files' order).
2. Consecutive row groups of that order form windows of at least ``window_rows`` rows
   (``data.shuffle.buffer_size``), and each window's rows are permuted (seeded by (seed,
   epoch, window)). So the shuffle is global over row groups and uniform within a window,
   as a shuffle buffer of that size would be, but repeatable.
3. Each rank reads its block: the windows it overlaps, each read once (its row groups with
   the column projection) and taken in the window's order. A window shared by two ranks'
   blocks is read by both, so a rank reads at most two windows more than its share. A
   window is at least one row group, whatever ``window_rows`` says: memory per rank is a
   few windows (``ParquetStream.tables``).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from raytrain.contract import StreamedSet
from raytrain.data.batch_format import batch_as
from raytrain.data.order import Interval, StreamSchedule, epoch_seed

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    from pyarrow.fs import FileSystem

# Windows read ahead of the one being batched, each by a thread of its own: on 2 cores
# and on 16, two reads in flight kept the batches waiting on none (bench/storage.py).
READ_AHEAD = 2
OPEN_FILES = 16  # Parquet files each reading thread keeps open


class EpochLayout:
    """An epoch's order of a streamed set (see the module docstring): which rows of which
    row groups its positions are."""

    def __init__(
        self, counts: Sequence[int], seed: int | None, epoch: int, window_rows: int
    ) -> None:
        import numpy as np

        self._seed, self._epoch = seed, epoch
        groups = np.arange(len(counts))
        if seed is not None:
            groups = np.random.default_rng(epoch_seed(seed, epoch)).permutation(len(counts))
        self.windows: list[list[int]] = []  # row-group indices, in order
        rows = window_rows  # the rows of the window being filled: none yet
        for group in groups.tolist():
            if seed is None or rows >= window_rows:  # unshuffled: a window per row group
                self.windows.append([])
                rows = 0
            self.windows[-1].append(group)
            rows += counts[group]
        # each window's first position, then the total
        self.starts = [0, *itertools.accumulate(sum(counts[g] for g in w) for w in self.windows)]

    def pieces(self, block: Sequence[Interval]) -> Iterator[tuple[int, int, int]]:
        """``block`` as (window, first, stop) runs of window-local positions, in order."""
        for lo, hi in block:
            while lo < hi:
                w = bisect.bisect_right(self.starts, lo) - 1
                stop = min(hi, self.starts[w + 1])
                yield w, lo - self.starts[w], stop - self.starts[w]
                lo = stop

    def window_order(self, window: int) -> np.ndarray | None:
        """The order of a window's rows (its row groups' rows concatenated); None when
        unshuffled: the files' order."""
        import numpy as np

        n = self.starts[window + 1] - self.starts[window]
        if self._seed is None:
            return None
        seed = epoch_seed(self._seed, self._epoch, window + 1)
        return np.random.default_rng(seed).permutation(n)


class WindowReader:
    """Reads a streamed set's windows: their row groups with the column projection. Each
    reading thread keeps its last ``OPEN_FILES`` files open (footers read once while open):
    a set of more files than the process may open at once still reads, and no two threads
    share a file."""

    def __init__(self, streamed: StreamedSet, filesystem: FileSystem, columns: list[str] | None):
        self.set = streamed
        self._fs = filesystem
        self._columns = columns
        self._local = threading.local()

    def _open(self, index: int) -> Any:
        """File ``index``, open in this thread: a ``ParquetFile``, or (text formats) the
        random-access file its blocks are read from."""
        import pyarrow.parquet as pq

        files: OrderedDict[int, Any] | None = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = OrderedDict()
        if index in files:
            files.move_to_end(index)
            return files[index]
        handle = self._fs.open_input_file(self.set.files[index])
        files[index] = pq.ParquetFile(handle) if self.set.format == "parquet" else handle
        if len(files) > OPEN_FILES:
            files.popitem(last=False)[1].close()
        return files[index]

    def _unit(self, file: int, unit: int) -> pa.Table:
        """A row group (Parquet) or a block of lines (CSV, JSON) as an Arrow table."""
        if self.set.format == "parquet":
            return self._open(file).read_row_group(unit, columns=self._columns)
        from raytrain.data.text_blocks import read_block

        return read_block(self.set, unit, self._columns, self._open(file))

    def read(self, layout: EpochLayout, window: int) -> pa.Table:
        """A window's rows in its order, as one Arrow table. A file that cannot be read is
        a ``TrainingFailed`` naming it."""
        import pyarrow as pa

        from raytrain.errors import TrainingFailed

        tables = []
        for group in layout.windows[window]:
            file, row_group, _ = self.set.row_groups[group]
            try:
                tables.append(self._unit(file, row_group))
            except Exception as exc:
                raise TrainingFailed(
                    f"data: cannot read {self.set.files[file]} (a file of {self.set.uri}): "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                ) from None
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        order = layout.window_order(window)
        return table if order is None else table.take(order)


def cut_batches(
    tables: Iterator[Any],
    sizes: Sequence[int],
    columns: list[str] | None,
    preprocess: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Iterator[Any]:
    """Batches of ``sizes`` rows cut from the Arrow ``tables`` in order, as dicts of tensors
    (or tuples in ``columns`` order); with ``preprocess`` (``data.preprocess``), each batch
    passes through it as Ray Data's numpy batch first, on this thread."""
    from ray.data.util.torch_utils import (
        arrow_batch_to_tensors,
        convert_ndarray_batch_to_torch_tensor_batch,
    )

    from raytrain._compat.ray_core import arrow_to_numpy

    def to_tensors(batch: pa.Table) -> Any:
        if preprocess is None:
            return arrow_batch_to_tensors(batch, combine_chunks=True)
        return convert_ndarray_batch_to_torch_tensor_batch(preprocess(arrow_to_numpy(batch)))

    for batch in cut_tables(tables, sizes):
        yield batch_as(to_tensors(batch), columns)


def cut_tables(tables: Iterator[Any], sizes: Sequence[int]) -> Iterator[Any]:
    """Arrow tables of ``sizes`` rows cut from ``tables`` in order."""
    import pyarrow as pa

    wanted = iter(sizes)
    size = next(wanted, None)
    held: list[Any] = []
    rows = 0
    for table in tables:
        held.append(table)
        rows += table.num_rows
        while size is not None and rows >= size:
            whole = pa.concat_tables(held) if len(held) > 1 else held[0]
            batch, rest = whole.slice(0, size), whole.slice(size)
            held, rows = ([rest], rest.num_rows) if rest.num_rows else ([], 0)
            yield batch
            size = next(wanted, None)


class ParquetStream(StreamSchedule):
    """This rank's batches of a streamed Parquet split, one pass per epoch, as dicts of
    tensors (or tuples, in ``tuple_columns`` order). Resumable: see ``StreamSchedule``."""

    def __init__(
        self,
        streamed: StreamedSet,
        filesystem: FileSystem,
        columns: list[str] | None,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        shuffle_seed: int | None = None,
        window_rows: int = 1,
        tuple_columns: list[str] | None = None,
        preprocess: str | None = None,
    ):
        super().__init__(streamed.num_rows, batch_size, rank=rank, world_size=world_size)
        self._reader = WindowReader(streamed, filesystem, columns)
        self._seed = shuffle_seed
        self._window_rows = window_rows
        self._tuple = tuple_columns
        self._preprocess = preprocess

    def tables(self, block: Sequence[Interval], epoch: int) -> Iterator[Any]:
        """The rows of ``block`` (positions of ``epoch``'s order) as Arrow tables, in order;
        the windows are read ahead in threads (``READ_AHEAD`` reads queued behind the one
        being cut, so a rank holds up to ``READ_AHEAD + 2`` windows, each at least a row
        group, and a shuffled copy of the one being read)."""
        layout = EpochLayout(self._reader.set.counts, self._seed, epoch, self._window_rows)
        pieces = list(layout.pieces(block))
        runs = [
            (w, [(lo, hi) for _, lo, hi in group])
            for w, group in itertools.groupby(pieces, key=lambda p: p[0])
        ]
        with ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="raytrain-read") as pool:
            ahead: deque[tuple[Future, list[tuple[int, int]]]] = deque()
            upcoming = iter(runs)
            try:
                while True:
                    while len(ahead) < READ_AHEAD + 1:
                        run = next(upcoming, None)
                        if run is None:
                            break
                        ahead.append((pool.submit(self._reader.read, layout, run[0]), run[1]))
                    if not ahead:
                        return
                    future, spans = ahead.popleft()
                    table = future.result()
                    for lo, hi in spans:
                        yield table.slice(lo, hi - lo)
            finally:
                for future, _ in ahead:
                    future.cancel()

    def __iter__(self) -> Iterator[Any]:
        # planned at the first batch, not when the iterator is made: Lightning makes it
        # before the epoch's hooks set the epoch (or a rollback its position)
        _, block, sizes = self.plan()
        preprocess = None
        if self._preprocess is not None:
            from raytrain.util.imports import import_object

            preprocess = import_object(self._preprocess)
        yield from cut_batches(self.tables(block, self.epoch), sizes, self._tuple, preprocess)


def row_groups(uri: str, filesystem: FileSystem, path: str) -> StreamedSet:
    """The Parquet files under ``path`` (sorted) and their row groups, from the footers,
    read in parallel threads (a prefix of many files on object storage)."""
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    files = sorted(pads.dataset(path, filesystem=filesystem, format="parquet").files)

    def groups(file: str) -> list[int]:
        meta = pq.ParquetFile(filesystem.open_input_file(file)).metadata
        return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]

    with ThreadPoolExecutor(16) as pool:
        counts = list(pool.map(groups, files))
    found = tuple((f, g, n) for f, rows in enumerate(counts) for g, n in enumerate(rows) if n)
    return StreamedSet(uri=uri, files=tuple(files), row_groups=found)
