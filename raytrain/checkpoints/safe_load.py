"""Reading checkpoints without running code from them.

A checkpoint is a pickle, and unpickling an arbitrary pickle runs arbitrary code (an object's
``__reduce__``). Whoever can write to the checkpoint storage must not be able to run code
where raytrain reads it: on the driver (``raytrain export``, the model logged to MLflow) or
on the workers (a resume). So every checkpoint raytrain reads goes through here:

- a torch file (DDP's or a full FSDP state dict's ``checkpoint.ckpt``, Lightning's
  ``meta.pt``): ``torch.load(weights_only=True)``, which accepts tensors, containers and
  primitives, plus the few types in ``SAFE_GLOBALS`` that Lightning checkpoints hold;
- a sharded FSDP checkpoint (torch distributed checkpoint, DCP): torch 2.13's reader
  unpickles ``.metadata`` with a plain ``pickle.load`` and each non-tensor entry with
  ``torch.load(weights_only=False)``, and it offers no safe reader or planner. Here
  ``.metadata`` is read by an unpickler that resolves only DCP's own metadata classes
  (``DCP_METADATA_GLOBALS``) and every non-tensor entry with ``weights_only=True``. Tensor
  entries torch already reads with ``weights_only=True``.

Every entry's bytes must lie in a regular file inside the checkpoint folder (links
resolved), within that file, untransformed, and a non-tensor entry, which the reader takes
into memory whole, no larger than ``MAX_BYTES_ENTRY``: torch's reader joins whatever path
``.metadata`` names to the folder (``../../x``, ``/etc/x``) and reads the length it gives.

A refused checkpoint is a ``StorageError`` (exit 2) naming the file and what it holds.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, BinaryIO, NoReturn

from raytrain._compat.torch import (
    LAYOUT_REBUILDER,
    layout_rebuilder,
    load_without_process_group,
    storage_info_class,
    whole_load_planner,
)
from raytrain.checkpoints.layout import DCP_METADATA
from raytrain.errors import StorageError

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
    from torch.distributed.checkpoint.planner import ReadItem

# DCP's metadata file inside a sharded checkpoint folder; Lightning's file beside it.
LIGHTNING_META = "meta.pt"
# A non-tensor entry is read whole into memory; Lightning's hold a strategy's small state
# (optimizer steps and param groups), its loops' and callbacks' state being in meta.pt.
MAX_BYTES_ENTRY = 256 * 2**20
# DCP metadata lists every shard of every tensor: megabytes for the largest models.
MAX_METADATA_BYTES = 1024 * 2**20


def safe_globals() -> list[Any]:
    """What a Lightning checkpoint may hold beyond ``weights_only``'s defaults: Lightning's
    hyperparameter container and paths (a hyperparameter that is a ``Path``). None of them
    runs code when rebuilt."""
    import pathlib

    from lightning.fabric.utilities.data import AttributeDict

    return [
        AttributeDict,
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        pathlib.WindowsPath,
        pathlib.PureWindowsPath,
    ]


@contextmanager
def lightning_globals() -> Iterator[None]:
    """``torch.load(weights_only=True)`` inside accepts ``safe_globals()`` too."""
    import torch

    with torch.serialization.safe_globals(safe_globals()):
        yield


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def refusal(label: str, exc: BaseException) -> StorageError:
    """The error for ``label`` that ``torch.load(weights_only=True)`` refused with ``exc``:
    a payload (a global outside the allow-list, named) or not a torch file at all."""
    found = _GLOBAL.search(str(exc))
    if isinstance(exc, pickle.UnpicklingError) and found:
        return StorageError(
            f"{label}: refused: it holds a pickled {found.group(1)}, which is not training "
            "state; raytrain loads checkpoints with torch.load(weights_only=True) and runs "
            "no code from them"
        )
    return StorageError(f"{label}: not a torch checkpoint ({_short(exc)})")


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def load_torch_file(path: str, label: str | None = None, *, mmap: bool = False) -> Any:
    """The object in torch file ``path``, loaded with ``weights_only=True`` on the CPU;
    ``mmap``: tensors stay on disk until read (to check a file without loading it)."""
    import torch

    label = label or path
    if not os.path.isfile(path):
        raise StorageError(f"{label}: not a file")
    try:
        with lightning_globals():
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        raise refusal(label, exc) from None


def dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """The globals a DCP ``.metadata`` pickle may name: DCP's metadata dataclasses and enum,
    the file reader's storage record, dtypes, ``torch.Size``, layouts by name, and paths
    (its ``checkpoint_id``). Rebuilding any of them runs no user code."""
    import collections
    import dataclasses
    import enum
    import pathlib

    import torch
    import torch.distributed.checkpoint.metadata as dcp_md

    allowed: dict[tuple[str, str], Any] = {}
    for name, value in vars(dcp_md).items():
        own = isinstance(value, type) and value.__module__ == dcp_md.__name__
        if own and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
            allowed[(dcp_md.__name__, name)] = value
    info = storage_info_class()
    allowed[(info.__module__, info.__name__)] = info
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            allowed[("torch", name)] = value
    allowed[("torch", "Size")] = torch.Size
    allowed[LAYOUT_REBUILDER] = layout_rebuilder()
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for cls in (
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        pathlib.WindowsPath,
        pathlib.PureWindowsPath,
    ):
        allowed[("pathlib", cls.__name__)] = cls
    return allowed


class _MetadataUnpickler(pickle._Unpickler):
    """Resolves only ``dcp_metadata_globals()``. Every way a pickle reaches a callable
    (GLOBAL, STACK_GLOBAL, INST, the extension registry) goes through ``find_class``, so a
    pickle naming anything else is refused before any of it runs.

    BUILD is restricted too: pickle's BUILD sets attributes on whatever object is below it,
    and with a class there (``GLOBAL pathlib.PosixPath`` then ``BUILD (None, {...})``) it
    would rewrite that class for the whole process. Only an instance of an allowed class is
    built, with a plain dict of its fields (or its own ``__setstate__``). Python's
    pure-Python unpickler is used because BUILD can be overridden only there; metadata
    files are small.
    """

    # the pure-Python unpickler's opcode table and stack (typeshed declares neither fully)
    dispatch: dict[int, Any] = dict(pickle._Unpickler.dispatch)  # type: ignore[misc]
    stack: list[Any]

    def __init__(self, file: BinaryIO, allowed: dict[tuple[str, str], Any]):
        super().__init__(file)
        self._allowed = allowed
        self._types = {v for v in allowed.values() if isinstance(v, type)}

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, type) or type(inst) not in self._types:
            raise pickle.UnpicklingError(
                f"GLOBAL BUILD of a {type(inst).__name__} is not allowed in DCP metadata"
            )
        if "__setstate__" not in vars(type(inst)) and not (
            isinstance(state, dict)
            and all(isinstance(k, str) and not k.startswith("__") for k in state)
        ):
            raise pickle.UnpicklingError(
                "GLOBAL BUILD with other than a dict of fields is not allowed in DCP metadata"
            )
        super().load_build()  # type: ignore[misc]  # in pickle.py, not in typeshed

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed") from None

    def persistent_load(self, pid: Any) -> NoReturn:
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def read_dcp_metadata(folder: str, label: str | None = None) -> Metadata:
    """The DCP ``Metadata`` of sharded checkpoint ``folder``, unpickled safely."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(folder, DCP_METADATA)
    label = os.path.join(label or folder, DCP_METADATA)
    try:
        _regular_size(path, label, MAX_METADATA_BYTES)
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle, dcp_metadata_globals()).load()
    except FileNotFoundError:
        raise StorageError(f"{label}: missing: not a sharded checkpoint") from None
    except StorageError:
        raise
    except Exception as exc:
        raise refusal(label, exc) from None
    if not isinstance(metadata, Metadata):
        raise StorageError(f"{label}: not DCP metadata (holds a {type(metadata).__name__})")
    return metadata


def _regular_size(path: str, label: str, limit: int | None = None) -> int:
    """The size of the regular file at ``path`` (links followed), at most ``limit``; else a
    ``StorageError``: a FIFO would block its reader, a device (``/dev/zero``) never end."""
    import stat

    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise StorageError(f"{label}: not a regular file")
    if limit is not None and info.st_size > limit:
        raise StorageError(f"{label}: {info.st_size} bytes, more than the limit of {limit}")
    return info.st_size


def check_shards(folder: str, metadata: Metadata, label: str) -> None:
    """Refuse ``metadata`` unless every entry's bytes lie in a regular file inside
    ``folder`` (its path relative, links resolved), within that file, untransformed, and a
    non-tensor entry within ``MAX_BYTES_ENTRY``: what torch's reader will read."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from raytrain._compat.torch import dcp_storage_entries

    root = os.path.realpath(folder)
    kinds = getattr(metadata, "state_dict_metadata", None)
    try:
        if not isinstance(kinds, dict):
            raise TypeError(f"state_dict_metadata is a {type(kinds).__name__}")
        entries = dcp_storage_entries(metadata)
    except TypeError as exc:
        raise StorageError(f"{label}: not DCP file-system metadata ({exc})") from None
    sizes: dict[str, int] = {}
    for fqn, path, offset, length, transforms in entries:
        where = f"{label} (entry {fqn})"
        if not isinstance(path, str) or os.path.isabs(path) or "\x00" in path:
            raise StorageError(
                f"{where}: its shard path {path!r} is not a path relative to the checkpoint folder"
            )
        real = os.path.realpath(os.path.join(root, path))
        if os.path.commonpath([root, real]) != root or real == root:
            raise StorageError(
                f"{where}: its shard path {path!r} leads out of the checkpoint folder"
            )
        if real not in sizes:
            try:
                sizes[real] = _regular_size(real, f"{where}: its shard {path}")
            except OSError as exc:
                raise StorageError(
                    f"{where}: its shard {path} cannot be read: {exc.strerror or exc}"
                ) from None
        if not (
            isinstance(offset, int)
            and isinstance(length, int)
            and offset >= 0
            and 0 <= length <= sizes[real] - offset
        ):
            raise StorageError(
                f"{where}: bytes {offset!r}+{length!r} are not within its "
                f"shard {path} ({sizes[real]} bytes)"
            )
        if transforms:
            raise StorageError(
                f"{where}: stored through transforms {transforms!r}, which "
                "raytrain's checkpoints never use"
            )
        if isinstance(kinds.get(fqn), BytesStorageMetadata) and length > MAX_BYTES_ENTRY:
            raise StorageError(
                f"{where}: a non-tensor entry of {length} bytes, more than "
                f"the limit of {MAX_BYTES_ENTRY}"
            )


def _safe_reader(folder: str, metadata: Any, label: str) -> FileSystemReader:
    """A DCP ``FileSystemReader`` for ``folder`` that returns ``metadata`` (read safely, by
    ``read_dcp_metadata``) instead of unpickling ``.metadata`` itself, once
    ``check_shards`` found every entry it will read inside the folder."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    check_shards(folder, metadata, label)

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(folder)


class _Refusals:
    """Where a planner's ``load_bytes`` records a refusal: torch wraps exceptions raised
    inside its load in a ``CheckpointException`` with the traceback in its text."""

    def __init__(self, label: str):
        self.label = label
        self.error: StorageError | None = None

    def load(self, fqn: str, value: io.BytesIO) -> Any:
        try:
            return _safe_bytes(self.label, fqn, value)
        except StorageError as exc:
            self.error = self.error or exc
            raise

    def run(self, load: Callable[[], object]) -> None:
        try:
            load()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            if self.error is not None:
                raise self.error from None
            raise StorageError(
                f"{self.label}: cannot read this sharded checkpoint ({_short(exc)})"
            ) from None


def _safe_bytes(label: str, fqn: str, value: io.BytesIO) -> Any:
    import torch

    try:
        with lightning_globals():
            return torch.load(value, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise refusal(f"{label} (entry {fqn})", exc) from None


def load_dcp(folder: str, keys: set[str] | None = None, label: str | None = None) -> dict:
    """The state in sharded checkpoint ``folder`` (only ``keys``' entries when given),
    merged on this CPU without a process group, every part read safely."""
    name = label or folder
    metadata = read_dcp_metadata(folder, label)
    refusals = _Refusals(name)

    # as torch's dcp_to_torch_save does: the public load() fills a copy of the dict
    state: dict[str, Any] = {}
    reader, planner = _safe_reader(folder, metadata, name), whole_load_planner(refusals.load, keys)
    refusals.run(lambda: load_without_process_group(state, reader, planner))
    return state


def verify_dcp(folder: str, label: str | None = None) -> None:
    """Check sharded checkpoint ``folder`` before a reader that trusts it (torch's, as
    Lightning uses it) loads it: its metadata, every non-tensor entry and Lightning's
    ``meta.pt`` must load safely. Tensor entries are not read (torch reads them with
    ``weights_only=True``), so this costs the small entries only, on every rank."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    name = label or folder
    metadata = read_dcp_metadata(folder, label)
    refusals = _Refusals(name)

    class BytesOnly(DefaultLoadPlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(
            self,
            state_dict: STATE_DICT_TYPE,
            metadata: Metadata | None = None,
            is_coordinator: bool = False,
        ) -> None:
            entries = metadata.state_dict_metadata.items() if metadata is not None else []
            only = {k: None for k, v in entries if isinstance(v, BytesStorageMetadata)}
            super().set_up_planner(only, metadata, is_coordinator)

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            refusals.load(read_item.dest_index.fqn, value)

    reader, planner = _safe_reader(folder, metadata, name), BytesOnly()
    refusals.run(lambda: load_without_process_group({}, reader, planner))
    meta = os.path.join(folder, LIGHTNING_META)
    if os.path.exists(meta):
        load_torch_file(meta, os.path.join(name, LIGHTNING_META), mmap=True)


def verify_checkpoint(path: str, label: str | None = None) -> None:
    """Check the Lightning checkpoint at local ``path`` (a file, or a sharded folder) before
    a reader that trusts it loads it: a worker's resume. A file is parsed with
    ``weights_only=True`` and its tensors memory-mapped, not read."""
    if os.path.isdir(path):
        verify_dcp(path, label)
    else:
        load_torch_file(path, label, mmap=True)
