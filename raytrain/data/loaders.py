"""Each worker's batches: cut from a cached split's Arrow blocks, or read from its shard of
a streamed one (see ``raytrain.data.sources`` for how a split takes one path or the other).

Both loaders give every rank the same number of batches, which DDP needs, and both are
resumable through Lightning's ``state_dict``/``load_state_dict`` loader protocol.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrain.contract import CachedSet, ImageSet, MixedSet, StreamedSet
from raytrain.data.batch_format import batch_as
from raytrain.data.order import EpochSchedule, epoch_seed
from raytrain.spec import DataSpec, SourceSpec, StorageSpec

if TYPE_CHECKING:
    import pyarrow as pa

logger = logging.getLogger(__name__)


class CachedBatches(EpochSchedule):
    """This rank's batches of a cached set (an Arrow table), one pass per epoch, as dicts
    of tensors (or tuples, in ``tuple_columns`` order): ``EpochSchedule``'s rows taken."""

    def __init__(
        self,
        table: pa.Table,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        shuffle_seed: int | None = None,
        tuple_columns: list[str] | None = None,
    ):
        super().__init__(
            table.num_rows, batch_size, rank=rank, world_size=world_size, shuffle_seed=shuffle_seed
        )
        self._table = table
        self._columns = tuple_columns

    def __iter__(self) -> Iterator[Any]:
        from ray.data.util.torch_utils import arrow_batch_to_tensors

        for rows in self.index_batches():
            batch = arrow_batch_to_tensors(self._table.take(rows), combine_chunks=True)
            yield batch_as(batch, self._columns)


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
        tuple_columns: list[str] | None = None,
    ):
        self._shard = shard
        self._columns = tuple_columns
        self._batch_size = batch_size
        self._seed = shuffle_seed
        self._buffer = shuffle_buffer
        self._rank = rank
        self._world = world_size
        self.epoch = 0
        self.position = 0  # Lightning's count of this epoch's batches begun
        self._skip: tuple[int, int] | None = None  # (epoch, batches to skip) after a restore
        # (epoch, batches read beyond Lightning's count of the epoch) after a restore: a
        # resize's different batches, a rollback's skipped ones
        self._offset: tuple[int, int] | None = None

    def state_dict(self) -> dict[str, int]:
        """Where training is in the data: saved in every Lightning checkpoint (``rows``:
        of the epoch, over all ranks)."""
        offset = self._offset[1] if self._offset and self._offset[0] == self.epoch else 0
        rows = (self.position + offset) * self._batch_size * self._world
        return {
            "epoch": self.epoch,
            "steps": self.position,
            "world_size": self._world,
            "rows": rows,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from ``state``: the next pass over its epoch skips what was trained
        (``rows``, or before it was saved, ``steps`` of ``world_size`` batches)."""
        self.epoch = int(state["epoch"])
        rows = int(
            state.get(
                "rows",
                int(state["steps"]) * self._batch_size * int(state.get("world_size", self._world)),
            )
        )
        skip = math.ceil(rows / (self._batch_size * self._world))
        self._skip = (self.epoch, skip)
        self.position = int(state["steps"])
        self._offset = (self.epoch, skip - self.position)

    def __iter__(self) -> Iterator[Any]:
        from ray.data.util.torch_utils import arrow_batch_to_tensors

        skip = self._skip[1] if self._skip is not None and self._skip[0] == self.epoch else 0
        self._skip = None
        kwargs: dict[str, Any] = {}
        if self._seed is not None:
            kwargs = {
                "local_shuffle_buffer_size": self._buffer,
                "local_shuffle_seed": epoch_seed(self._seed, self.epoch, self._rank),
            }
        # Arrow batches, made tensors here as the cached path does: Ray Data's numpy
        # format turns list columns (a feature vector per row) into object arrays, which
        # cost a Python loop per row to become a tensor.
        batches = self._shard.iter_batches(
            batch_size=self._batch_size, batch_format="pyarrow", prefetch_batches=2, **kwargs
        )
        for batch in itertools.islice(batches, skip, None):
            yield batch_as(arrow_batch_to_tensors(batch, combine_chunks=True), self._columns)


def worker_loaders(
    data: DataSpec,
    cached: Mapping[str, CachedSet],
    streamed: Mapping[str, StreamedSet | ImageSet],
    mixed: Mapping[str, MixedSet],
    options: StorageSpec | None,
    rank: int,
    world_size: int,
) -> tuple[Any, Any | None]:
    """This worker's train and val loaders of file sources: cached sets from the object
    store, streamed Parquet read by this rank, and Ray Data's shards Ray Train handed it."""
    here = _Worker(data, options, rank, world_size)
    seed = data.shuffle.seed if data.shuffle else None
    train = _loader(here, "train", seed, cached, streamed, mixed)
    val = _loader(here, "val", None, cached, streamed, mixed) if data.val is not None else None
    return train, val


@dataclass(frozen=True)
class _Worker:
    """What every loader of this worker is cut for: the data section, the stores'
    options, and this rank among ``world_size``."""

    data: DataSpec
    options: StorageSpec | None
    rank: int
    world_size: int

    @property
    def columns(self) -> list[str] | None:
        """The batch's columns in order, where batches are tuples (``data.batch_format``)."""
        return self.data.columns if self.data.batch_format == "tuple" else None

    @property
    def window(self) -> int:
        """Rows a streamed loader shuffles within (1: no shuffle)."""
        return self.data.shuffle.buffer_size if self.data.shuffle else 1

    def source(self, name: str) -> SourceSpec:
        source = self.data.train if name == "train" else self.data.val
        assert isinstance(source, SourceSpec)
        return source


def _loader(
    here: _Worker,
    name: str,
    seed: int | None,
    cached: Mapping[str, CachedSet],
    streamed: Mapping[str, StreamedSet | ImageSet],
    mixed: Mapping[str, MixedSet],
) -> Any:
    """The loader of split ``name``, by the path its data took (``sources.choose_path``)."""
    data, rank, world = here.data, here.rank, here.world_size
    if name in mixed:
        from raytrain.data.mix import mixed_loader

        return mixed_loader(
            mixed[name],
            here.options,
            data.columns,
            data.batch_size,
            rank=rank,
            world_size=world,
            shuffle_seed=seed,
            window_rows=here.window,
            tuple_columns=here.columns,
        )
    part = streamed.get(name)
    if isinstance(part, ImageSet) or (isinstance(part, StreamedSet) and part.images):
        return image_loader(
            data,
            part,
            here.options,
            here.source(name),
            rank=rank,
            world_size=world,
            seed=seed,
            tuple_columns=here.columns,
        )
    if isinstance(part, StreamedSet):
        return _parquet_loader(here, part, seed)
    if name in cached:
        return _cached_loader(here, cached[name], seed)
    import ray.train

    return ShardBatches(
        ray.train.get_dataset_shard(name),
        data.batch_size,
        shuffle_seed=seed,
        shuffle_buffer=data.shuffle.buffer_size if data.shuffle else 0,
        rank=rank,
        world_size=world,
        tuple_columns=here.columns,
    )


def _parquet_loader(here: _Worker, part: StreamedSet, seed: int | None) -> Any:
    """A streamed split, read by this rank from its store."""
    from raytrain import storage
    from raytrain.data.parquet_stream import ParquetStream

    fs, _ = storage.filesystem(part.uri, here.options)
    return ParquetStream(
        part,
        fs,
        here.data.columns,
        here.data.batch_size,
        rank=here.rank,
        world_size=here.world_size,
        shuffle_seed=seed,
        window_rows=here.window,
        tuple_columns=here.columns,
        preprocess=here.data.preprocess,
    )


def _cached_loader(here: _Worker, cached: CachedSet, seed: int | None) -> CachedBatches:
    """A cached split: its Arrow blocks come out of the object store zero-copy, and the
    batches are cut from them."""
    import pyarrow as pa
    import ray

    return CachedBatches(
        pa.concat_tables(ray.get(cached.refs)),
        here.data.batch_size,
        rank=here.rank,
        world_size=here.world_size,
        shuffle_seed=seed,
        tuple_columns=here.columns,
    )


def image_loader(
    data: DataSpec,
    images: ImageSet | StreamedSet,
    options: StorageSpec | None,
    source: SourceSpec,
    *,
    rank: int,
    world_size: int,
    seed: int | None,
    tuple_columns: list[str] | None,
) -> Any:
    """This rank's ``ImageStream`` of an image split (``PackedImageStream``: packed images):
    ``data.num_workers`` decoding processes (unset: the CPUs Ray gave this worker, at least
    1), pinned memory when training on a GPU."""
    import ray
    import torch

    from raytrain import storage
    from raytrain.data.image_stream import ImageFiles, ImageStream, PackedImageStream

    workers = data.num_workers
    if workers is None:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        workers = max(1, int(cpus))
    fs, _ = storage.filesystem(images.uri, options)
    pin = torch.cuda.is_available()
    if isinstance(images, StreamedSet):
        decoder = ImageFiles(
            None, fs, source.image_size, source.image_mode, data.transform, data.preprocess
        )
        return PackedImageStream(
            images,
            fs,
            decoder,
            data.batch_size,
            rank=rank,
            world_size=world_size,
            shuffle_seed=seed,
            window_rows=data.shuffle.buffer_size if data.shuffle else 1,
            num_workers=workers,
            pin_memory=pin,
            tuple_columns=tuple_columns,
        )
    files = ImageFiles(
        images, fs, source.image_size, source.image_mode, data.transform, data.preprocess
    )
    return ImageStream(
        files,
        data.batch_size,
        rank=rank,
        world_size=world_size,
        shuffle_seed=seed,
        num_workers=workers,
        pin_memory=pin,
        tuple_columns=tuple_columns,
    )
