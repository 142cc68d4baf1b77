"""An image folder read by each rank itself: its block of every epoch's order, decoded in
a pool of processes.

Every epoch's order is a permutation of the listed files seeded by (seed, epoch) (unshuffled:
the sorted listing), cut into ranks' blocks and batches by ``StreamSchedule`` as a streamed
Parquet split's rows are: every image once per epoch, the same number of batches on every
rank without dropping one (``step_slices``' rule), and a restore on any world size trains
exactly the images the epoch had left.

A rank's batches are fetched by a ``torch.utils.data.DataLoader`` over ``ImageFiles`` with
the batches as its ``batch_sampler``: ``num_workers`` processes (kept across epochs) read,
decode, resize and ``transform`` each batch, ``prefetch_factor`` batches ahead of training,
into pinned memory on GPUs. That is the library made for this (and the baseline a user
would write), so raytrain adds only the order and the resumable position. Its processes
start by ``forkserver``: a training worker holds Ray's threads and object-store clients,
which a ``fork`` would copy mid-use. A batch's files are read by threads (``FETCH_THREADS``
reads in flight per process): one GET per object is the cost on object storage.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrain.contract import ImageSet, StreamedSet
from raytrain.data.batch_format import batch_as
from raytrain.data.image_files import open_image
from raytrain.data.order import Interval, StreamSchedule, epoch_order
from raytrain.data.parquet_stream import ParquetStream, cut_tables

if TYPE_CHECKING:
    import numpy as np
    from pyarrow.fs import FileSystem
    from torch.utils.data import DataLoader

FETCH_THREADS = 16  # reads in flight per decoding process
PREFETCH = 4  # batches each decoding process works ahead


def _as_is(batch: Any) -> Any:
    """``collate_fn``: ``ImageFiles`` gives whole batches already (module level: pickled)."""
    return batch


class ImageFiles:
    """A map-style dataset of an ``ImageSet``'s files, fetched a batch at a time
    (``__getitems__``): each file read (threads), decoded (``open_image``), passed through
    ``transform`` (per image: it gets a PIL image, as torchvision's transforms do; no
    transform: the pixels as uint8, (H, W) or (H, W, C)), stacked into ``image`` with
    ``label`` (the class index, when there are class folders), then ``preprocess`` (per
    batch, dicts of numpy arrays) and made tensors. ``transform`` and ``preprocess`` are
    import paths, imported in the process that uses them."""

    def __init__(
        self,
        images: ImageSet | None,
        filesystem: FileSystem,
        size: Sequence[int] | None,
        mode: str | None,
        transform: str | None = None,
        preprocess: str | None = None,
    ):
        self.images = images or ImageSet(uri="", files=(), labels=None)
        self._fs = filesystem
        self._size, self._mode = size, mode
        self._paths = (transform, preprocess)
        self._calls: tuple[Callable[..., Any] | None, Callable[..., Any] | None] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return self.images.num_rows

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_calls": None, "_pool": None}  # made again where it lands

    def _read(self, index: int) -> bytes:
        path = self.images.files[index]
        try:
            with self._fs.open_input_stream(path) as handle:
                return bytes(handle.read())
        except Exception as exc:
            raise _unreadable(self.images, path, exc) from None

    def __getitems__(self, indices: Sequence[int] | PackedBatch) -> dict[str, Any]:
        """A batch of the folder's files by index, or of packed images (``PackedBatch``)."""
        import numpy as np
        import torch

        if self._calls is None:
            from raytrain.util.imports import import_object

            self._calls = tuple(import_object(p) if p else None for p in self._paths)  # type: ignore[assignment]
            self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="raytrain-fetch")
        assert self._calls is not None and self._pool is not None
        transform, preprocess = self._calls
        if isinstance(indices, PackedBatch):
            datas, paths, labels = indices.images, indices.paths, indices.labels
        else:
            datas = list(self._pool.map(self._read, indices))
            paths = [self.images.files[i] for i in indices]
            labels = None
            if self.images.labels is not None:
                labels = [self.images.labels[i] for i in indices]
        pixels = []
        for path, data in zip(paths, datas, strict=True):
            try:
                image = open_image(data, self._size, self._mode)
            except Exception as exc:
                raise _undecodable(self.images, path, exc) from None
            if transform is None:
                pixels.append(np.asarray(image))
                continue
            try:
                pixels.append(np.asarray(transform(image)))
            except Exception as exc:
                raise _failed("transform", self._paths[0], path, exc) from exc
        shapes = {p.shape for p in pixels}
        if len(shapes) > 1:
            raise _mixed_shapes(self.images.uri, paths, pixels)
        batch: dict[str, Any] = {"image": np.stack(pixels)}
        if labels is not None:
            batch["label"] = np.array(labels, dtype=np.int64)
        if preprocess is not None:
            try:
                batch = preprocess(batch)
            except Exception as exc:
                raise _failed("preprocess", self._paths[1], paths[0], exc) from exc
        return {
            k: torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
            for k, v in batch.items()
        }

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])


@dataclass(frozen=True)
class PackedBatch:
    """A batch of packed images (``raytrain pack``), read by the training process and handed
    to a decoding process as the ``batch_sampler``'s item: encoded bytes, their source
    paths (for messages), their labels (or None)."""

    images: list[bytes]
    paths: list[str]
    labels: list[int] | None


def _failed(field: str, function: str | None, path: str, exc: Exception) -> Exception:
    """A user's ``data.transform`` or ``data.preprocess`` that raised: named, with the image
    (or the batch's first) it was given. A ``BadDataError``: the same images would fail it
    again, so it is not retried."""
    from raytrain.errors import BadDataError

    detail = str(exc).splitlines()[0] if str(exc) else ""
    return BadDataError(f"data.{field} {function} failed on {path}: {type(exc).__name__}: {detail}")


def _undecodable(images: ImageSet, path: str, exc: Exception) -> Exception:
    from raytrain.errors import BadDataError

    detail = str(exc).splitlines()[0] if str(exc) else ""
    return BadDataError(
        f"data: the image {path} (of {images.uri or 'a packed set'}) does not "
        f"decode: {type(exc).__name__}: {detail}"
    )


def _unreadable(images: ImageSet, path: str, exc: Exception) -> Exception:
    from raytrain.errors import TrainingFailed

    detail = str(exc).splitlines()[0] if str(exc) else ""
    return TrainingFailed(
        f"data: cannot read the image {path} (a file of {images.uri}): "
        f"{type(exc).__name__}: {detail}"
    )


def _mixed_shapes(uri: str, paths: Sequence[str], pixels: Sequence[Any]) -> Exception:
    """The error for a batch whose images differ in shape: two of them named."""
    from raytrain.errors import BadDataError

    first = pixels[0].shape
    other = next(i for i, p in enumerate(pixels) if p.shape != first)
    return BadDataError(
        f"data: images of {uri or 'a packed set'} differ in shape within a batch: {paths[0]} "
        f"is {first}, {paths[other]} is {pixels[other].shape}; set the source's image_size "
        "(and image_mode, e.g. RGB) or a data.transform that makes them one shape"
    )


def _decoded(loader: Any) -> Iterator[Any]:
    """The pool's batches; an error of ours raised in a decoding process comes back as the
    DataLoader re-raises it (its first line "Caught ... in DataLoader worker process 0", the
    process's traceback after): raised again with our message alone, which is what the
    run's failure line shows."""
    from raytrain.errors import BadDataError, TrainingFailed

    try:
        yield from loader
    except (BadDataError, TrainingFailed) as exc:
        text = str(exc)
        if not text.startswith("Caught "):
            raise
        last = text.rstrip().splitlines()[-1]
        raise type(exc)(last.split(f"{type(exc).__name__}: ", 1)[-1]) from None


class _Batches:
    """The ``batch_sampler``: this pass's batches (of file indices, or ``PackedBatch``es
    read as the loader asks for them), set before each pass (a DataLoader with persistent
    processes iterates the same sampler object every epoch)."""

    def __init__(self) -> None:
        self.batches: Iterable[Any] = []
        self.count = 0

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def __len__(self) -> int:
        return self.count


def pool_loader(files: ImageFiles, sampler: _Batches, workers: int, pin: bool) -> DataLoader:
    """The DataLoader that decodes a rank's batches: ``workers`` forkserver processes kept
    across epochs, ``PREFETCH`` batches ahead each (0 workers: on this thread)."""
    from torch.utils.data import DataLoader

    extra: dict[str, Any] = {}
    if workers > 0:
        extra = {
            "persistent_workers": True,
            "prefetch_factor": PREFETCH,
            "multiprocessing_context": "forkserver",
        }
    return DataLoader(
        files,  # type: ignore[arg-type]  # a map-style dataset, not a torch Dataset
        batch_sampler=sampler,
        collate_fn=_as_is,
        num_workers=workers,
        pin_memory=pin,
        **extra,
    )


def block_batches(
    order: np.ndarray, block: Sequence[Interval], sizes: Sequence[int]
) -> list[list[int]]:
    """The file indices of each batch: ``block``'s positions of the epoch's ``order``, cut
    into batches of ``sizes`` (which sum to the block's length)."""
    import numpy as np

    if not block:
        return []
    picked = np.concatenate([order[lo:hi] for lo, hi in block])
    cuts = np.cumsum([0, *sizes])
    assert cuts[-1] == len(picked), (cuts[-1], len(picked))
    return [picked[a:b].tolist() for a, b in itertools.pairwise(cuts)]


class ImageStream(StreamSchedule):
    """This rank's batches of an image folder, one pass per epoch, as dicts of tensors (or
    tuples, in ``tuple_columns`` order). Resumable: see ``StreamSchedule``."""

    def __init__(
        self,
        files: ImageFiles,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        shuffle_seed: int | None = None,
        num_workers: int = 1,
        pin_memory: bool = False,
        tuple_columns: list[str] | None = None,
    ):
        super().__init__(files.images.num_rows, batch_size, rank=rank, world_size=world_size)
        self._files = files
        self._seed = shuffle_seed
        self._workers = num_workers
        self._pin = pin_memory
        self._tuple = tuple_columns
        self._sampler = _Batches()
        self._loader: Any = None

    def order(self) -> np.ndarray:
        """This epoch's order of the files (the same on every rank)."""
        return epoch_order(self.num_rows, self._seed, self.epoch)

    def _data_loader(self) -> Any:
        if self._loader is None:
            self._loader = pool_loader(self._files, self._sampler, self._workers, self._pin)
        return self._loader

    def __iter__(self) -> Iterator[Any]:
        # planned at the first batch, not when the iterator is made (as ParquetStream)
        _, block, sizes = self.plan()
        batches = block_batches(self.order(), block, sizes)
        self._sampler.batches, self._sampler.count = batches, len(batches)
        if not batches:
            return
        for batch in _decoded(self._data_loader()):
            yield batch_as(batch, self._tuple)


class PackedImageStream(ParquetStream):
    """This rank's batches of packed images (``raytrain pack``: Parquet rows of an encoded
    ``image``, a ``path`` and a ``label``), as an image folder's: the rows read as any
    streamed Parquet split's (the epoch's order over row groups and windows, read ahead in
    threads, exact on resume), each batch's encoded images handed to the decoding processes
    as a ``PackedBatch`` (one read per row group, not one per image)."""

    def __init__(
        self,
        streamed: StreamedSet,
        filesystem: FileSystem,
        files: ImageFiles,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        shuffle_seed: int | None = None,
        window_rows: int = 1,
        num_workers: int = 1,
        pin_memory: bool = False,
        tuple_columns: list[str] | None = None,
    ):
        super().__init__(
            streamed,
            filesystem,
            None,
            batch_size,
            rank=rank,
            world_size=world_size,
            shuffle_seed=shuffle_seed,
            window_rows=window_rows,
        )
        self._files, self._workers, self._pin = files, num_workers, pin_memory
        self._images_tuple = tuple_columns
        self._sampler = _Batches()
        self._loader: Any = None

    def __iter__(self) -> Iterator[Any]:
        _, block, sizes = self.plan()
        if not sizes:
            return

        def packed() -> Iterator[PackedBatch]:
            for table in cut_tables(self.tables(block, self.epoch), sizes):
                names = table.column_names
                labels = table.column("label").to_pylist() if "label" in names else None
                yield PackedBatch(
                    table.column("image").to_pylist(), table.column("path").to_pylist(), labels
                )

        self._sampler.batches, self._sampler.count = packed(), len(sizes)
        if self._loader is None:
            self._loader = pool_loader(self._files, self._sampler, self._workers, self._pin)
        for batch in _decoded(self._loader):
            yield batch_as(batch, self._images_tuple)
