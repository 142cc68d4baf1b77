"""What the driver hands every Ray Train worker: one typed, frozen object.

Ray Train passes ``train_loop_config`` (a dict) to each worker by pickling it. raytrain puts
exactly one entry in it, a ``WorkerConfig``, under ``CONFIG_KEY``: the driver builds it
(``driver.launcher``) and the worker reads it (``worker.loop``), so the fields each side
relies on are checked by the type checker, not by string keys. Nothing here imports Ray,
torch or Lightning: both sides import it.

The other direction, what a worker sends the driver, is ``contract.events``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raytrain.spec import JobSpec

if TYPE_CHECKING:
    import pyarrow as pa
    from ray.actor import ActorHandle

CONFIG_KEY = "raytrain"
# The folder where a warm worker process marks itself ready (``worker.warm_ready``), set
# by the cluster ``raytrain up`` starts (``driver.local_cluster``) for its processes.
WARM_DIR_ENV = "RAYTRAIN_WARM_DIR"


@dataclass(frozen=True)
class CachedSet:
    """A split read once into the object store: the refs of its Arrow blocks.

    The driver owns the blocks; holding the refs keeps them alive for the whole run.
    """

    refs: list[Any]  # ray.ObjectRef of pyarrow Tables, in row order
    rows: int = 0  # how many rows they hold


@dataclass(frozen=True)
class StreamedSet:
    """A split each rank streams from its files itself: where its row groups are (Parquet),
    or its blocks of lines (CSV, JSON Lines: ``data.text_blocks``).

    The driver reads the files' footers (or parses the text files) once; the workers plan
    every epoch from these counts alone (``data.parquet_stream``), so all ranks agree on
    the order without talking."""

    uri: str  # the split's URI, for messages
    files: tuple[str, ...]  # paths in the filesystem ``storage.filesystem(uri)`` gives
    # (file index, unit, rows): the unit is the row group in the file (Parquet), or the
    # index into ``blocks`` (CSV, JSON)
    row_groups: tuple[tuple[int, int, int], ...]
    format: str = "parquet"  # parquet, csv or json
    # packed images (``raytrain pack``): rows of an encoded ``image`` and a ``label``, decoded
    # by each rank's decoding processes as an image folder's files are
    images: bool = False
    blocks: tuple[tuple[int, int], ...] = ()  # text formats: each block's (offset, length)
    schema: pa.Schema = None  # text formats: the pyarrow schema every block is parsed into

    @property
    def counts(self) -> list[int]:
        """Each row group's rows, in ``row_groups`` order: what an epoch's order is cut from."""
        return [rows for _, _, rows in self.row_groups]

    @property
    def num_rows(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class ImageSet:
    """A split of image files each rank reads and decodes itself: their paths and labels.

    The driver lists the files once (sorted); every rank plans each epoch's order from
    their count alone (``data.image_stream``), as for a ``StreamedSet``'s rows."""

    uri: str  # the split's URI, for messages
    files: tuple[str, ...]  # paths in the filesystem ``storage.filesystem(uri)`` gives
    labels: tuple[int, ...] | None  # each file's class index; None: no class folders
    classes: tuple[str, ...] = ()  # the class folders' names, by index
    skipped: int = 0  # files left out of the listing as unreadable (``data.bad_images``)
    sizes: tuple[int, ...] = ()  # each file's bytes, from the listing

    @property
    def num_rows(self) -> int:
        return len(self.files)


@dataclass(frozen=True)
class MixedSet:
    """A train set mixed from several sources, each cached or streamed (``data.mix``)."""

    names: tuple[str, ...]  # each source's name in metrics
    weights: tuple[float, ...]
    parts: tuple[CachedSet | StreamedSet, ...]
    rows: tuple[int, ...]  # each source's rows
    epoch_rows: int  # an epoch's rows, drawn from the sources by weight


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs beyond what Ray Train itself gives it (its rank, its
    streamed shards, the latest checkpoint)."""

    spec: JobSpec  # the validated job spec
    sink: ActorHandle | None = None  # the MetricsSink actor rank 0 publishes events to
    cached: Mapping[str, CachedSet] = field(default_factory=dict)  # by split name
    streamed: Mapping[str, StreamedSet | ImageSet] = field(default_factory=dict)  # by split
    mixed: Mapping[str, MixedSet] = field(default_factory=dict)  # by split name (train)
    chaos: ActorHandle | None = None  # failure.chaos's ChaosMonkey every rank marks
    keeper: ActorHandle | None = None  # the StateKeeper of checkpoint.memory_every_n_steps

    def as_train_loop_config(self) -> dict[str, Any]:
        """The ``train_loop_config`` Ray Train pickles to every worker."""
        return {CONFIG_KEY: self}

    @classmethod
    def from_train_loop_config(cls, config: Mapping[str, Any]) -> WorkerConfig:
        """The worker's side of ``as_train_loop_config``; anything else is a bug, said so."""
        value = config.get(CONFIG_KEY)
        if not isinstance(value, cls):
            raise TypeError(
                f"train_loop_config[{CONFIG_KEY!r}] is {type(value).__name__}, not a "
                "WorkerConfig: the driver and the worker run different raytrain code"
            )
        return value
