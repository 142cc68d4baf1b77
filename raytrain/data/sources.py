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
- **Streamed** (larger), Parquet: each rank reads its own block of every epoch's order from
  the files, row group by row group, with pyarrow (``parquet_stream``). The driver reads only
  the footers. The order is a function of (seed, epoch) and the row-group counts, so every
  row is seen once per epoch and a restore on any world size trains exactly the rows left,
  as for a cached set. Memory stays bounded: a few row groups per rank.
- **Images, read per rank**: an image folder is listed once here (``image_files``), and
  each rank reads and decodes its block of every epoch's order in a pool of processes
  (``image_stream``), exact as a streamed Parquet split is; ``data.preprocess`` and
  ``data.transform`` run in that pool.
- **Streamed through Ray Data**: images with ``data.preprocess_on`` (decoding and
  preprocessing on the CPU nodes it picks: what Ray Data is for), CSV, JSON and Parquet
  sets with ``data.preprocess`` too large to cache. Ray Train splits them with
  ``streaming_split`` into equal shards, and ``ShardBatches`` iterates each worker's shard
  with a seeded local shuffle buffer. Ray Data hands blocks to shards as they ask, so this
  path is exact in count only: a restore trains the right number of rows, and an equal
  split drops at most ``num_workers - 1`` rows of a set per epoch.

A mixed train set (``data.train`` a list) places each source as a split of its own would
be, cached or streamed, and ``data.mix`` draws every epoch from them by weight.

All give every rank the same number of batches, which DDP needs: the same number of train
steps on every rank, and every rank at the end-of-validation metric sync (a rank with an
empty val shard never reaches it, and the others wait forever).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raytrain import storage
from raytrain.contract import CachedSet, ImageSet, MixedSet, StreamedSet
from raytrain.spec import DataSpec, JobSpec, MixSourceSpec, SourceSpec, StorageSpec
from raytrain.spec.data import epoch_rows_problem

if TYPE_CHECKING:
    import pyarrow as pa
    import ray.data
    from pyarrow.fs import FileSystem
    from ray.train import DataConfig

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
    on: dict[str, str] | None = None,
) -> ray.data.Dataset:
    """A lazy Ray Dataset over ``source``: read (and, for images, decoded and resized) by
    Ray Data tasks, with the column projection pushed into the reader, then ``preprocess``
    as a ``map_batches`` step; all its tasks on the nodes the label selector ``on`` picks
    (``data_nodes``)."""
    import ray.data

    fs, path = storage.filesystem(source.uri, options)
    if source.format == "images":
        ds = _read_images(source, fs, path)
    else:
        readers = {
            "parquet": ray.data.read_parquet,
            "csv": ray.data.read_csv,
            "json": ray.data.read_json,
        }
        ds = readers[source.format](path, filesystem=fs)
    if columns:
        ds = ds.select_columns(columns)  # pushed down into the Parquet reader
    if preprocess:
        from raytrain.util.imports import import_object

        ds = ds.map_batches(import_object(preprocess), batch_format="numpy")
    if on:  # this dataset's own copy of Ray Data's context: its every task carries it
        ds.context.execution_options.label_selector = dict(on)
    return ds


def data_nodes(
    data: DataSpec, use_gpu: bool, cluster_nodes: Callable[[], list[dict[str, Any]]]
) -> dict[str, str] | None:
    """The label selector for Ray Data's tasks: ``data.preprocess_on`` when set (``{}``:
    anywhere); unset, on a GPU run, the alive nodes (``cluster_nodes``: ``ray.nodes``,
    asked only then) without a GPU when there are any, so that decoding and preprocessing
    leave the training nodes' CPUs to their workers; else anywhere (None)."""
    if data.preprocess_on is not None:
        return data.preprocess_on or None
    if not use_gpu:
        return None
    nodes = cluster_nodes()
    cpu_only = sorted(
        n["NodeID"] for n in nodes if n.get("Alive") and not n.get("Resources", {}).get("GPU")
    )
    if not cpu_only or len(cpu_only) == sum(1 for n in nodes if n.get("Alive")):
        return None
    return {"ray.io/node-id": f"in({','.join(cpu_only)})"}


def _read_images(source: SourceSpec, fs: FileSystem, path: str) -> ray.data.Dataset:
    """Image files under ``path`` as an ``image`` column (HWC uint8), decoded and resized on
    Ray Data workers, plus ``label``: the index of the file's class folder, if any."""
    import ray.data

    from raytrain.data.image_files import IMAGE_EXTENSIONS, image_classes

    classes = image_classes(fs, path)
    ds = ray.data.read_images(
        path,
        filesystem=fs,
        size=(source.image_size[0], source.image_size[1]) if source.image_size else None,
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


def read_table(
    source: SourceSpec, columns: list[str] | None, options: StorageSpec | None = None
) -> pa.Table:
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


def choose_path(data: DataSpec, source: SourceSpec, nbytes: int, store_bytes: float) -> str:
    """How a split reaches the workers: ``driver`` (read here, cached), ``materialize``
    (read by Ray Data, cached), ``stream`` (each rank reads its Parquet row groups, or CSV
    and JSON blocks, every epoch), ``images`` (each rank reads and decodes its image files
    every epoch) or ``ray_data`` (read by Ray Data every epoch)."""
    images = source.format == "images"
    transformed = images or data.preprocess is not None
    mode = data.cache
    fits = nbytes * MEMORY_EXPANSION <= store_bytes * CACHE_FRACTION
    if mode == "never" or (mode == "auto" and (transformed or not fits)):
        if data.preprocess_on is not None and transformed:  # decoded, mapped on those nodes
            return "ray_data"
        return "images" if images else "stream"
    if nbytes <= DRIVER_READ_BYTES and not transformed:
        return "driver"
    return "materialize"


@dataclass
class Splits:
    """The splits of a run, keyed train/val, by how they reach the workers."""

    ray_data: dict[str, Any] = field(default_factory=dict)  # Ray Datasets Ray Train shards
    cached: dict[str, CachedSet] = field(default_factory=dict)
    streamed: dict[str, StreamedSet | ImageSet] = field(default_factory=dict)  # read per rank
    mixed: dict[str, MixedSet] = field(default_factory=dict)
    data_nodes: dict[str, str] | None = None  # where Ray Data's tasks run (``data_nodes``)

    def paths(self) -> dict[str, str]:
        """Each split's path, as ``TrainResult.data_paths`` names it."""
        return {
            **{k: "ray_data" for k in self.ray_data},
            **{k: "streamed" for k in self.streamed},
            **{k: "cached" for k in self.cached},
            **{k: "mixed" for k in self.mixed},
        }


def build_datasets(spec: JobSpec, object_store_bytes: float) -> Splits:
    """The splits of ``spec``; none when the workers build their data (a DataModule, the
    model's own loaders)."""
    import ray

    splits = Splits()
    data = spec.files
    if data is None:
        return splits
    splits.data_nodes = data_nodes(data, spec.scaling.use_gpu is True, ray.nodes)
    if splits.data_nodes:
        logger.info("Ray Data's tasks run on the nodes %s", splits.data_nodes)
    if isinstance(data.train, list):
        splits.mixed["train"] = _mix(spec, data.train, object_store_bytes, splits.data_nodes)
    else:
        _place(spec, "train", data.train, object_store_bytes, splits)
    if data.val is not None:
        _place(spec, "val", data.val, object_store_bytes, splits)
    return splits


def _place(
    spec: JobSpec,
    name: str,
    source: SourceSpec,
    object_store_bytes: float,
    splits: Splits,
    min_rows: int | None = None,
) -> None:
    """Put split ``name`` into ``splits`` by the path ``choose_path`` takes for it; it must
    hold ``min_rows`` rows (default: a row for each worker)."""
    least = spec.scaling.max_workers if min_rows is None else min_rows
    import ray

    data, options = spec.files, spec.storage
    assert data is not None
    nbytes = source_bytes(source, options) if source.format != "images" else 0
    path = choose_path(data, source, nbytes, object_store_bytes)
    if path == "driver":
        table = read_table(source, data.columns, options)
        _check_rows(name, source, table.num_rows, least)
        splits.cached[name] = CachedSet([ray.put(table)], table.num_rows)
    elif path == "materialize":
        try:
            ds = read_source(
                source, data.columns, options, data.preprocess, splits.data_nodes
            ).materialize()
        except Exception as exc:
            if source.format == "images" or data.preprocess is not None:
                raise
            raise unreadable_data(source, data.columns, options, exc) from None
        rows = ds.count()
        _check_rows(name, source, rows, least)
        splits.cached[name] = CachedSet(ds.to_arrow_refs(), rows)
    elif path == "stream":
        logger.info(
            "%s set: each rank streams its %s rows from %s every epoch",
            name,
            source.format,
            source.uri,
        )
        found = stream_plan(source, options)
        _check_rows(name, source, found.num_rows, least)
        splits.streamed[name] = found
    elif path == "images":
        logger.info(
            "%s set: each rank reads and decodes its images from %s every epoch", name, source.uri
        )
        images = image_plan(source, options, data.bad_images)
        _check_rows(name, source, images.num_rows, least)
        splits.streamed[name] = images
    else:
        check_shardable(spec, name, source)
        logger.info("%s set: streamed by Ray Data from %s every epoch", name, source.uri)
        splits.ray_data[name] = read_source(
            source, data.columns, options, data.preprocess, splits.data_nodes
        )


def check_shardable(spec: JobSpec, name: str, source: SourceSpec) -> None:
    """Refuse a split streamed by Ray Data under tensor parallelism: Ray Train splits it
    into one shard per worker, but the ranks of a tensor-parallel group must read the same
    rows (raytrain's own loaders shard by replica, ``worker.strategy.data_rank``)."""

    tp = spec.strategy.replica_size
    if tp == 1:
        return
    from raytrain.errors import SpecError

    raise SpecError(
        [
            f"data.{name}: {source.uri} would be streamed by Ray Data (data.preprocess_on), "
            "which gives each worker other rows; with "
            f"{tp} workers to a model replica (strategy.model_parallel's "
            "tensor_parallel_size x pipeline_parallel_size) the workers of a replica must "
            "read the same rows: drop data.preprocess_on (each worker then reads and "
            "preprocesses its own rows), or data.cache: always"
        ]
    )


def _mix(
    spec: JobSpec,
    sources: list[MixSourceSpec],
    object_store_bytes: float,
    on: dict[str, str] | None,
) -> MixedSet:
    """A mixed train set: each source cached or streamed as a split of its own would be."""
    parts: list[CachedSet | StreamedSet] = []
    rows = []
    for j, source in enumerate(sources):
        one = Splits(data_nodes=on)
        # a source repeats as the mix draws it: one row will do (epoch_rows is checked)
        _place(spec, f"train.{j}", source, object_store_bytes, one, min_rows=1)
        part = one.cached.get(f"train.{j}") or one.streamed[f"train.{j}"]
        assert not isinstance(part, ImageSet)  # a mix reads Parquet only (the spec says)
        parts.append(part)
        rows.append(part.rows if isinstance(part, CachedSet) else part.num_rows)
    assert spec.files is not None
    epoch = spec.files.epoch_rows or sum(rows)
    too_many = epoch_rows_problem(epoch, len(sources))
    if epoch < spec.scaling.max_workers or too_many:
        from raytrain.errors import SpecError

        unset = "" if spec.files.epoch_rows else "unset, so all the sources' rows: "
        raise SpecError(
            [
                f"data.epoch_rows: {unset}{too_many}"
                if too_many
                else f"data.epoch_rows: {epoch} rows cannot give each of "
                f"{spec.scaling.max_workers} workers a batch"
            ]
        )
    return MixedSet(
        names=tuple(s.label() for s in sources),
        weights=tuple(s.weight for s in sources),
        parts=tuple(parts),
        rows=tuple(rows),
        epoch_rows=epoch,
    )


def stream_plan(source: SourceSpec, options: StorageSpec | None) -> StreamedSet:
    """A Parquet split's files and row groups, read from their footers, or a CSV or JSON
    split's blocks (``text_blocks.plan_text``, a ``SpecError`` naming a file that does not
    parse); a file that cannot be read is a ``TrainingFailed`` naming it."""
    from raytrain.data.parquet_stream import row_groups

    fs, path = storage.filesystem(source.uri, options)
    if source.format != "parquet":
        from raytrain.data.text_blocks import BadRows, plan_text

        try:
            return plan_text(source.uri, fs, path, source.format)
        except BadRows as exc:
            from raytrain.errors import SpecError

            raise SpecError([f"data: {exc}"]) from None
    try:
        return row_groups(source.uri, fs, path)
    except Exception as exc:
        raise unreadable_data(source, None, options, exc) from None


def image_plan(source: SourceSpec, options: StorageSpec | None, bad: str) -> ImageSet | StreamedSet:
    """An image split's files and labels (``image_files.list_images``); the headers are read
    only to leave unreadable files out (``bad: skip``: the preflight checked them under
    ``error``). Problems with the folder are a ``SpecError`` naming ``source.uri``. Images
    packed by ``raytrain pack``: their shards' row groups, as a ``StreamedSet`` of images."""
    from raytrain.data.image_files import BadImages, list_images, packed_manifest, read_labels

    fs, path = storage.filesystem(source.uri, options)
    try:
        packed = packed_manifest(fs, path)
    except BadImages as exc:
        from raytrain.errors import SpecError

        raise SpecError([f"data: {exc}"]) from None
    if packed is not None:
        import dataclasses

        return dataclasses.replace(
            stream_plan(source.model_copy(update={"format": "parquet"}), options), images=True
        )
    try:
        labels = None if source.labels is None else read_labels(source.labels, options)
        images = list_images(source.uri, fs, path, bad=bad, check=bad == "skip", labels=labels)
    except BadImages as exc:
        from raytrain.errors import SpecError

        raise SpecError([f"data: {exc}"]) from None
    if images.skipped:
        logger.warning(
            "%s: %d image files that do not decode are left out (data.bad_images: skip)",
            source.uri,
            images.skipped,
        )
    return images


def _check_rows(name: str, source: SourceSpec, rows: int, workers: int) -> None:
    if rows < workers:
        from raytrain.errors import SpecError

        raise SpecError(
            [
                f"data.{name}.uri: {rows} rows at {source.uri} cannot give each of {workers} "
                "workers a batch (fewer rows than scaling.num_workers)"
            ]
        )


def dataset_config(on: dict[str, str] | None = None) -> DataConfig:
    """How Ray Train shards the Ray Data sets: equal ``streaming_split`` shards, their tasks
    on the nodes the label selector ``on`` picks. (Ray Train replaces each dataset's
    execution options with these, so a selector set on the dataset alone is lost.)"""
    from ray.train import DataConfig

    if not on:
        return DataConfig(datasets_to_split="all")
    options = DataConfig.default_ingest_options()
    options.label_selector = dict(on)
    return DataConfig(datasets_to_split="all", execution_options=options)
