"""torch internals raytrain relies on, written for torch 2.13 (``versions.SUPPORTED``).

- ``grad_norms``: ``torch._foreach_norm``, one fused kernel for the norm of every gradient.
- ``LAYOUT_REBUILDER``: ``torch.serialization._get_layout``, the global a pickled
  ``torch.layout`` names (DCP metadata holds them).
- ``set_element``: ``torch.distributed.checkpoint._nested_dict.set_element``, which puts a
  value read from a flattened DCP key back into the nested state dict.
- ``empty_state_dict_planner``: ``default_planner._EmptyStateDictLoadPlanner``, the planner
  that loads a whole DCP checkpoint into an empty dict (as ``dcp_to_torch_save`` does).
- ``load_without_process_group``: ``state_dict_loader._load_state_dict(..., no_dist=True)``,
  a DCP load on one process without a process group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

LAYOUT_REBUILDER = ("torch.serialization", "_get_layout")


def grad_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of each tensor in ``grads``, stacked."""
    import torch

    return torch.stack(torch._foreach_norm(grads))


def layout_rebuilder() -> Any:
    """The function ``LAYOUT_REBUILDER`` names."""
    import torch

    return torch.serialization._get_layout


def set_element(root: dict[str, Any], path: Any, value: Any) -> None:
    """Set ``value`` at ``path`` (DCP's object path) inside ``root``."""
    from torch.distributed.checkpoint._nested_dict import set_element as _set

    _set(root, path, value)


def empty_state_dict_planner() -> type:
    """DCP's planner that fills an empty state dict with everything a checkpoint holds."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    return _EmptyStateDictLoadPlanner


def load_without_process_group(state: dict[str, Any], reader: Any, planner: Any) -> None:
    """Load a DCP checkpoint through ``reader`` and ``planner`` into ``state``, here."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state, reader, planner=planner, no_dist=True)
