"""Datasets: Ray Data sources on the driver, per-worker batch loaders on the workers.

The driver builds one Ray Dataset per split with the spec's column projection. A dataset
small enough for the object store is materialised once, so epochs reuse it instead of
re-reading the files (Ray Data re-executes a lazy dataset on every epoch). Both sets are
split into equal per-worker shards (see ``dataset_config``).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator
from typing import Any

from raytrain import storage
from raytrain.spec import JobSpec, SourceSpec

logger = logging.getLogger(__name__)

# Parquet expands several-fold in memory; materialise only what fits comfortably.
_MEMORY_EXPANSION = 4
_CACHE_FRACTION = 0.25


def read_source(source: SourceSpec, columns: list[str] | None) -> Any:
    """A lazy Ray Dataset over ``source``."""
    import ray.data

    uri = storage.resolve(source.uri)
    fs, path = storage.filesystem(uri)
    readers = {
        "parquet": ray.data.read_parquet,
        "csv": ray.data.read_csv,
        "json": ray.data.read_json,
    }
    ds = readers[source.format](path, filesystem=fs)
    # Ray Data pushes the projection down into the Parquet reader.
    return ds.select_columns(columns) if columns else ds


def source_bytes(source: SourceSpec) -> int:
    """Bytes of the files under ``source.uri``."""
    import pyarrow.fs as pafs

    fs, path = storage.filesystem(source.uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return info.size or 0
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    return sum(i.size or 0 for i in infos if i.type == pafs.FileType.File)


def build_datasets(spec: JobSpec, object_store_bytes: float) -> dict[str, Any]:
    """The Ray Datasets for ``spec``: ``train`` and, when configured, ``val``."""
    out = {}
    for name in ("train", "val"):
        source = getattr(spec.data, name)
        if source is None:
            continue
        ds = read_source(source, spec.data.columns)
        if source_bytes(source) * _MEMORY_EXPANSION <= object_store_bytes * _CACHE_FRACTION:
            ds = ds.materialize()
        else:
            logger.info("%s set is larger than the object store budget: streaming it", name)
        out[name] = ds
    return out


def dataset_config() -> Any:
    """How Ray Train shards the datasets: every split into equal per-worker shards.

    Equal shards are what DDP needs: every rank runs the same number of train steps, and
    every rank takes part in the end-of-validation metric sync (a rank with an empty val
    shard would never reach it, and the others would wait forever). An equal split drops
    at most ``num_workers - 1`` rows of a set.
    """
    from ray.train import DataConfig

    return DataConfig(datasets_to_split="all")


class ShardBatches:
    """A re-iterable over this worker's shard: one pass per epoch, as dicts of tensors.

    The train set's local shuffle is seeded by (seed, epoch, rank), so each epoch has its own
    order and a rerun of an epoch repeats it.
    """

    def __init__(
        self,
        shard: Any,
        batch_size: int,
        *,
        shuffle_seed: int | None = None,
        shuffle_buffer: int = 0,
        rank: int = 0,
    ):
        self._shard = shard
        self._batch_size = batch_size
        self._seed = shuffle_seed
        self._buffer = shuffle_buffer
        self._rank = rank
        self.epoch = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        kwargs: dict[str, Any] = {}
        if self._seed is not None:
            key = f"{self._seed}/{self.epoch}/{self._rank}".encode()
            kwargs = {
                "local_shuffle_buffer_size": self._buffer,
                "local_shuffle_seed": zlib.crc32(key),
            }
        return iter(
            self._shard.iter_torch_batches(
                batch_size=self._batch_size, device="cpu", prefetch_batches=2, **kwargs
            )
        )


def worker_loaders(spec: JobSpec, rank: int) -> tuple[ShardBatches, ShardBatches | None]:
    """This worker's train and val loaders, from the shards Ray Train handed it."""
    import ray.train

    shuffle = spec.data.shuffle
    train = ShardBatches(
        ray.train.get_dataset_shard("train"),
        spec.data.batch_size,
        shuffle_seed=shuffle.seed if shuffle else None,
        shuffle_buffer=shuffle.buffer_size if shuffle else 0,
        rank=rank,
    )
    val = None
    if spec.data.val is not None:
        val = ShardBatches(ray.train.get_dataset_shard("val"), spec.data.batch_size, rank=rank)
    return train, val
