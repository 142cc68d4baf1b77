"""Datasets: Ray Data sources on the driver, per-worker batch loaders on the workers.

Each split, with the spec's column projection, takes one of two paths:

- **Cached** (it fits the object-store budget): read once into the object store: by the
  driver with pyarrow when small (``DRIVER_READ_BYTES``: no Ray Data tasks or actors to
  start), else by Ray Data's ``materialize``. Every worker gets the blocks' object refs and
  reads them zero-copy from the object store.
  ``CachedBatches`` then cuts each epoch's batches from an order that depends only on
  (seed, epoch): a global permutation of all rows, cut into steps of one batch per rank
  (``step_slices``), so every row is seen exactly once per epoch. Epochs do not re-read
  files (Ray Data would re-execute a lazy dataset every epoch), and no coordinator actor,
  epoch barrier or stats reporting runs during training.
- **Streamed** (larger): Ray Train splits it with Ray Data's ``streaming_split`` into equal
  shards, and ``ShardBatches`` iterates each worker's shard with a seeded local shuffle
  buffer. Memory stays bounded.

Both give every rank the same number of batches, which DDP needs: the same number of train
steps on every rank, and every rank at the end-of-validation metric sync (a rank with an
empty val shard never reaches it, and the others wait forever). A cached set loses no row; an
equal streamed split drops at most ``num_workers - 1`` rows of a set per epoch.
"""

from __future__ import annotations

import itertools
import logging
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from raytrain import storage
from raytrain.spec import JobSpec, SourceSpec, StorageSpec

logger = logging.getLogger(__name__)

# Parquet expands several-fold in memory; cache only what fits comfortably.
MEMORY_EXPANSION = 4
CACHE_FRACTION = 0.25
# Up to this many bytes of files, the driver reads a split itself (one pyarrow read, about
# 0.1 s for the digits) instead of starting Ray Data read tasks (about 6 s here, on 2 cores).
DRIVER_READ_BYTES = 64 * 2**20


def read_source(
    source: SourceSpec,
    columns: list[str] | None,
    options: StorageSpec | None = None,
    preprocess: str | None = None,
) -> Any:
    """A lazy Ray Dataset over ``source``: read (and, for images, decoded and resized) by
    Ray Data tasks, with the column projection pushed into the reader, then ``preprocess``
    as a ``map_batches`` step."""
    import ray.data

    fs, path = storage.filesystem(source.uri, options)
    if source.format == "images":
        ds = _read_images(source, fs, path)
    else:
        readers = {"parquet": ray.data.read_parquet, "csv": ray.data.read_csv,
                   "json": ray.data.read_json}  # fmt: skip
        ds = readers[source.format](path, filesystem=fs)
    if columns:
        ds = ds.select_columns(columns)  # pushed down into the Parquet reader
    if preprocess:
        from raytrain.preflight import import_object

        ds = ds.map_batches(import_object(preprocess), batch_format="numpy")
    return ds


IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "tif", "tiff", "bmp", "gif")


def image_classes(fs: Any, path: str) -> list[str]:
    """The class names of an image folder: its subfolders, sorted (torchvision's
    ``ImageFolder`` convention); none when the images lie directly in it."""
    import pyarrow.fs as pafs

    entries = fs.get_file_info(pafs.FileSelector(path))
    return sorted(e.base_name for e in entries if e.type == pafs.FileType.Directory)


def _read_images(source: SourceSpec, fs: Any, path: str) -> Any:
    """Image files under ``path`` as an ``image`` column (HWC uint8), decoded and resized on
    Ray Data workers, plus ``label``: the index of the file's class folder, if any."""
    import ray.data

    classes = image_classes(fs, path)
    ds = ray.data.read_images(
        path,
        filesystem=fs,
        size=tuple(source.image_size) if source.image_size else None,
        mode=source.image_mode,
        include_paths=bool(classes),
        file_extensions=list(IMAGE_EXTENSIONS),
    )
    if not classes:
        return ds
    index = {name: i for i, name in enumerate(classes)}

    def label(batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        paths = batch.pop("path")
        batch["label"] = np.array([index[p.rsplit("/", 2)[-2]] for p in paths], dtype=np.int64)
        return batch

    return ds.map_batches(label, batch_format="numpy")


def source_bytes(source: SourceSpec, options: StorageSpec | None = None) -> int:
    """Bytes of the files under ``source.uri``."""
    import pyarrow.fs as pafs

    fs, path = storage.filesystem(source.uri, options)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return info.size or 0
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return sum(i.size or 0 for i in infos if i.type == pafs.FileType.File)


@dataclass
class CachedSet:
    """A split read once into the object store: the refs of its Arrow blocks.

    The driver owns the blocks; holding the refs keeps them alive for the whole run.
    """

    refs: list[Any]


def read_table(
    source: SourceSpec, columns: list[str] | None, options: StorageSpec | None = None
) -> Any:
    """The whole of ``source`` as one pyarrow Table, read here. A file that cannot be read
    (a corrupt page, a truncated file) is a ``TrainingFailed`` naming it."""
    import pyarrow.dataset as pads

    fs, path = storage.filesystem(source.uri, options)
    dataset = pads.dataset(path, filesystem=fs, format=source.format)
    try:
        return dataset.to_table(columns=columns)
    except Exception as exc:
        raise unreadable_data(source, columns, options, exc) from None


def unreadable_data(
    source: SourceSpec, columns: list[str] | None, options: StorageSpec | None, exc: Exception
) -> Exception:
    """The error for a split whose read failed with ``exc``: names the first of its files
    that pyarrow cannot read on its own (the read failed somewhere among them), and the
    store's words, on one line."""
    import pyarrow.dataset as pads

    from raytrain.errors import TrainingFailed

    bad, why = source.uri, exc
    try:
        fs, path = storage.filesystem(source.uri, options)
        for fragment in pads.dataset(path, filesystem=fs, format=source.format).get_fragments():
            try:
                fragment.to_table(columns=columns)
            except Exception as fragment_exc:
                bad, why = fragment.path, fragment_exc
                break
    except Exception:
        pass  # the listing itself fails: the first error says why
    detail = storage.describe(why).splitlines()[0] if str(why) else type(why).__name__
    return TrainingFailed(
        f"data: cannot read {bad} (a file of {source.uri}): {type(why).__name__}: {detail}"
    )


def choose_path(spec: JobSpec, source: SourceSpec, nbytes: int, store_bytes: float) -> str:
    """How a split reaches the workers: ``driver`` (read here, cached), ``materialize``
    (read by Ray Data, cached) or ``stream`` (read by Ray Data every epoch)."""
    transformed = source.format == "images" or spec.data.preprocess is not None
    mode = spec.data.cache
    fits = nbytes * MEMORY_EXPANSION <= store_bytes * CACHE_FRACTION
    if mode == "never" or (mode == "auto" and (transformed or not fits)):
        return "stream"
    if nbytes <= DRIVER_READ_BYTES and not transformed:
        return "driver"
    return "materialize"


def build_datasets(
    spec: JobSpec, object_store_bytes: float
) -> tuple[dict[str, Any], dict[str, CachedSet]]:
    """The splits of ``spec``: (streamed Ray Datasets, cached sets), keyed train/val."""
    import ray

    streamed: dict[str, Any] = {}
    cached: dict[str, CachedSet] = {}
    data, options = spec.data, spec.storage
    for name in ("train", "val"):
        source = getattr(data, name)
        if source is None:
            continue
        nbytes = source_bytes(source, options) if source.format != "images" else 0
        path = choose_path(spec, source, nbytes, object_store_bytes)
        if path == "driver":
            table = read_table(source, data.columns, options)
            _check_rows(name, source, table.num_rows, spec.scaling.max_workers)
            cached[name] = CachedSet([ray.put(table)])
        elif path == "materialize":
            try:
                ds = read_source(source, data.columns, options, data.preprocess).materialize()
            except Exception as exc:
                if source.format == "images" or data.preprocess is not None:
                    raise
                raise unreadable_data(source, data.columns, options, exc) from None
            _check_rows(name, source, ds.count(), spec.scaling.max_workers)
            cached[name] = CachedSet(ds.to_arrow_refs())
        else:
            logger.info("%s set: streamed from %s every epoch", name, source.uri)
            streamed[name] = read_source(source, data.columns, options, data.preprocess)
    return streamed, cached


def _check_rows(name: str, source: SourceSpec, rows: int, workers: int) -> None:
    if rows < workers:
        from raytrain.errors import SpecError

        raise SpecError(
            [f"data.{name}.uri: {rows} rows at {source.uri} cannot give each of {workers} "
             "workers a batch (fewer rows than scaling.num_workers)"]
        )  # fmt: skip


def dataset_config() -> Any:
    """How Ray Train shards the streamed sets: equal ``streaming_split`` shards."""
    from ray.train import DataConfig

    return DataConfig(datasets_to_split="all")


def _epoch_seed(seed: int, epoch: int, rank: int = 0) -> int:
    return zlib.crc32(f"{seed}/{epoch}/{rank}".encode())


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


class CachedBatches:
    """This rank's batches of a cached set, one pass per epoch, as dicts of tensors.

    The epoch's order is a permutation of all rows seeded by (seed, epoch), the same on every
    rank (no shuffle: the stored order). ``step_slices`` cuts it into steps and each step
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
        table: Any,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        shuffle_seed: int | None = None,
    ):
        self._table = table
        self._batch_size = batch_size
        self._rank = rank
        self._world = world_size
        self._seed = shuffle_seed
        self.epoch = 0
        # Lightning's count of this epoch's batches begun (set by ``LoaderPosition``).
        self.position = 0
        # A mid-epoch restore: (epoch, steps done, rows of its order done) until it is used.
        self._resume: tuple[int, int, int] | None = None
        # The pass under way: its epoch and schedule.
        self._pass: tuple[int, tuple[int, int, list[list[tuple[int, int]]]]] | None = None

    def _schedule(self) -> tuple[int, int, list[list[tuple[int, int]]]]:
        """This epoch's (steps already done, first row, steps left as slices of the order)."""
        if self._pass is not None and self._pass[0] == self.epoch:
            return self._pass[1]
        n = self._table.num_rows
        done, start = 0, 0
        if self._resume is not None and self._resume[0] == self.epoch:
            _, done, start = self._resume
        left = n - start
        if left == 0:
            return done, start, []
        if left < self._world:  # only after a resize: too few rows left to give each rank one
            logger.warning("%d rows left in epoch %d for %d workers: skipped", left, self.epoch,
                           self._world)  # fmt: skip
            return done, n, []
        steps = step_slices(left, self._batch_size, self._world)
        return done, start, [[(lo + start, hi + start) for lo, hi in step] for step in steps]

    def __len__(self) -> int:
        done, _, steps = self._schedule()
        return done + len(steps)

    def order(self) -> Any:
        """The current epoch's order of all rows (the same on every rank)."""
        import numpy as np

        n = self._table.num_rows
        if self._seed is None:
            return np.arange(n)
        return np.random.default_rng(_epoch_seed(self._seed, self.epoch)).permutation(n)

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
        self._resume = (self.epoch, int(state["steps"]), int(state["rows"]))
        self.position = int(state["steps"])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from ray.data.util.torch_utils import arrow_batch_to_tensors

        order = self.order()
        self._pass = None
        schedule = self._schedule()
        self._pass, self._resume = (self.epoch, schedule), None  # later passes: whole epochs
        for step in schedule[2]:
            lo, hi = step[self._rank]
            yield arrow_batch_to_tensors(self._table.take(order[lo:hi]), combine_chunks=True)


class ShardBatches:
    """This worker's shard of a streamed set: one pass per epoch, as dicts of tensors.

    The local shuffle is seeded by (seed, epoch, rank), so each epoch has its own order.

    Resumable like ``CachedBatches``, by count: restored mid-epoch, it skips as many rows of
    its shard as the ranks had trained in that epoch (read and dropped: a stream cannot seek).
    Ray Data hands out a stream's blocks to the shards as they ask, so after a restart a
    shard need not hold the same rows as before: the epoch trains the right number of rows,
    not necessarily the same ones. Exactly-once per row holds for cached sets.
    """

    def __init__(
        self,
        shard: Any,
        batch_size: int,
        *,
        shuffle_seed: int | None = None,
        shuffle_buffer: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        self._shard = shard
        self._batch_size = batch_size
        self._seed = shuffle_seed
        self._buffer = shuffle_buffer
        self._rank = rank
        self._world = world_size
        self.epoch = 0
        self.position = 0  # Lightning's count of this epoch's batches begun
        self._skip: tuple[int, int] | None = None  # (epoch, batches to skip) after a restore

    def state_dict(self) -> dict[str, int]:
        """Where training is in the data: saved in every Lightning checkpoint."""
        return {"epoch": self.epoch, "steps": self.position, "world_size": self._world}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from ``state``: the next pass over its epoch skips what was trained."""
        self.epoch = int(state["epoch"])
        rows = int(state["steps"]) * self._batch_size * int(state.get("world_size", self._world))
        self._skip = (self.epoch, math.ceil(rows / (self._batch_size * self._world)))
        self.position = int(state["steps"])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from ray.data.util.torch_utils import arrow_batch_to_tensors

        skip = self._skip[1] if self._skip is not None and self._skip[0] == self.epoch else 0
        self._skip = None
        kwargs: dict[str, Any] = {}
        if self._seed is not None:
            kwargs = {
                "local_shuffle_buffer_size": self._buffer,
                "local_shuffle_seed": _epoch_seed(self._seed, self.epoch, self._rank),
            }
        # Arrow batches, made tensors here as the cached path does: Ray Data's numpy
        # format turns list columns (a feature vector per row) into object arrays, which
        # cost a Python loop per row to become a tensor.
        batches = self._shard.iter_batches(
            batch_size=self._batch_size, batch_format="pyarrow", prefetch_batches=2, **kwargs
        )
        for batch in itertools.islice(batches, skip, None):
            yield arrow_batch_to_tensors(batch, combine_chunks=True)


def worker_loaders(
    spec: JobSpec, cached: dict[str, CachedSet], rank: int, world_size: int
) -> tuple[Any, Any | None]:
    """This worker's train and val loaders: cached sets from the object store, streamed
    ones from the shards Ray Train handed it."""
    import ray
    import ray.train

    shuffle = spec.data.shuffle

    def loader(name: str, seed: int | None) -> Any:
        if name in cached:
            import pyarrow as pa

            # Arrow blocks come out of the object store zero-copy; batches are cut from them.
            table = pa.concat_tables(ray.get(cached[name].refs))
            return CachedBatches(
                table, spec.data.batch_size, rank=rank, world_size=world_size, shuffle_seed=seed
            )
        return ShardBatches(
            ray.train.get_dataset_shard(name), spec.data.batch_size, shuffle_seed=seed,
            shuffle_buffer=shuffle.buffer_size if shuffle else 0, rank=rank,
            world_size=world_size,
        )  # fmt: skip

    train = loader("train", shuffle.seed if shuffle else None)
    val = loader("val", None) if spec.data.val is not None else None
    return train, val
