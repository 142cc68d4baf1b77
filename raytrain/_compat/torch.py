"""torch internals raytrain relies on, written for torch 2.13 (``versions.SUPPORTED``).

- ``grad_norms``: ``torch._foreach_norm``, one fused kernel for the norm of every gradient.
- ``LAYOUT_REBUILDER``: ``torch.serialization._get_layout``, the global a pickled
  ``torch.layout`` names (DCP metadata holds them).
- ``whole_load_planner``: ``default_planner._EmptyStateDictLoadPlanner``, the planner that
  loads a whole DCP checkpoint into an empty dict (as ``dcp_to_torch_save`` does),
  subclassed so that every non-tensor entry is read by the caller's loader, not
  ``torch.load``; it puts each value back with
  ``torch.distributed.checkpoint._nested_dict.set_element``.
- ``load_without_process_group``: ``state_dict_loader._load_state_dict(..., no_dist=True)``,
  a DCP load on one process without a process group.
- ``copy_all``: ``torch._foreach_copy_``, one call that copies a list of tensors into a
  list of others (a node copy's keep: 0.04 ms for the digits CNN's 32 tensors, where a
  ``copy_`` each took 0.12 ms).
- ``weights_only_unpickle``: ``torch._weights_only_unpickler.load``, the unpickler
  ``torch.load(weights_only=True)`` runs on a checkpoint's ``data.pkl``, run on a plain
  pickle (of protocol 2, torch's) with no tensors in it: a packed state's skeleton, read by
  the same allow-list as a checkpoint without ``torch.save``'s zip container (0.3 ms of a
  0.5 ms keep on digits).
- ``storage_info_class``: ``filesystem._StorageInfo`` itself, which a DCP checkpoint's
  metadata pickles: the safe loader allows it by its module and name.
- ``dcp_storage_entries``: the fields of ``filesystem._StorageInfo``, the file reader's
  record of where each entry's bytes lie (``relative_path``, joined to the checkpoint
  folder by ``FileSystemReader.read_data``; ``offset``, ``length``;
  ``transform_descriptors``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import io

    import torch
    from torch.distributed.checkpoint import LoadPlanner, StorageReader
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import ReadItem

LAYOUT_REBUILDER = ("torch.serialization", "_get_layout")


def grad_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of each tensor in ``grads``, stacked."""
    import torch

    return torch.stack(torch._foreach_norm(grads))


def layout_rebuilder() -> Callable[[str], torch.layout]:
    """The function ``LAYOUT_REBUILDER`` names."""
    import torch

    return torch.serialization._get_layout


def whole_load_planner(
    load: Callable[[str, Any], Any], keys: set[str] | None = None
) -> LoadPlanner:
    """DCP's planner that fills an empty state dict with everything a checkpoint holds
    (only ``keys``' entries when given), each non-tensor entry read by ``load(fqn, bytes)``
    (the bytes a ``BytesIO``)."""
    from torch.distributed.checkpoint._nested_dict import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = load(fqn, value)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return Planner(keys=keys)


def load_without_process_group(
    state: dict[str, Any], reader: StorageReader, planner: LoadPlanner
) -> None:
    """Load a DCP checkpoint through ``reader`` and ``planner`` into ``state``, here."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state, reader, planner=planner, no_dist=True)


def dcp_storage_entries(metadata: Metadata) -> list[tuple[str, Any, Any, Any, Any]]:
    """Each storage entry of DCP ``metadata``, as its file reader finds its bytes: (the
    entry's key, its path relative to the checkpoint folder, offset, length, transforms),
    whatever types the file holds; a ``TypeError`` when they are not such records."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    if not isinstance(metadata.storage_data, dict):
        raise TypeError(f"storage_data is a {type(metadata.storage_data).__name__}")
    out = []
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise TypeError(f"a storage entry {type(index).__name__}: {type(info).__name__}")
        out.append(
            (
                str(index.fqn),
                info.relative_path,
                info.offset,
                info.length,
                info.transform_descriptors,
            )
        )
    return out


def weights_only_unpickle(data: bytes) -> Any:
    """The object pickled in ``data`` (protocol 2, no tensors), unpickled as
    ``torch.load(weights_only=True)`` unpickles a checkpoint: only the allowed globals
    (torch's own and those of an enclosing ``torch.serialization.safe_globals``); any
    other raises ``pickle.UnpicklingError``."""
    import io

    from torch import _weights_only_unpickler

    return _weights_only_unpickler.load(io.BytesIO(data))


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each of ``sources`` into the tensor of ``targets`` at its place (same shapes;
    any devices and dtypes ``copy_`` takes), without recording them for autograd."""
    import torch

    with torch.no_grad():
        torch._foreach_copy_(targets, sources)


def storage_info_class() -> type:
    """DCP's file reader's record of where an entry's bytes lie (``_StorageInfo``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo
