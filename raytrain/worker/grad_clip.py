"""Gradient clipping over parameters that mix DTensors and plain tensors.

Under tensor parallelism a model's parameters are DTensors on the tensor-parallel mesh
(the sharded layers), DTensors on the data-parallel mesh (FSDP2's shards), and, where no
FSDP2 wraps them, plain tensors (the embeddings of a model run with tensor parallelism
alone). ``torch.nn.utils.clip_grad_norm_`` computes one ``_foreach_norm`` over them all,
which DTensor refuses ("got mixed torch.Tensor and DTensor"). Lightning clips through
its precision plugin with that function, so the model-parallel strategy clips with these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import torch.distributed as dist


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard, else ``tensor`` itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _groups(parameters: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The gradients of ``parameters``, grouped so each group is one kind: plain tensors,
    or DTensors of one mesh and placements (what one norm computation takes together)."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        key = (id(grad.device_mesh), grad.placements) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    return list(groups.values())


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    counted: Callable[[torch.Tensor], bool] | None = None,
    across: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so their global 2-norm is at most
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does; returns the norm before.

    The global norm is the norm of each group's norm: a DTensor group's is computed on its
    local shards and reduced over its mesh (``full_tensor``), so every rank returns and
    scales by the same norm. A collective where there are DTensors: every rank calls it.
    Under a pipeline each stage holds part of the model: ``across`` (its process group)
    sums the stages' squared norms, and ``counted(param)`` leaves out of this stage's
    share a parameter another stage counts (a tied embedding both ends hold).
    """
    from torch.distributed.tensor import DTensor

    params = list(parameters)
    groups = _groups(p for p in params if counted is None or counted(p))
    norms = [torch.zeros(())]
    for grads in groups:
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).cpu())
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    if across is not None:
        import torch.distributed as dist

        squared = (total**2).to(_device(params))
        dist.all_reduce(squared, group=across)
        total = squared.cpu().sqrt()
    coef = min(1.0, max_norm / (float(total) + 1e-6))  # a Python float: scales any kind
    if coef < 1.0:
        for grads in _groups(params):
            for grad in grads:
                grad.mul_(coef)
    return total


def _device(params: list[torch.Tensor]) -> torch.device:
    """Where a collective over these parameters' group runs (NCCL: the GPU)."""
    return params[0].device if params else torch.device("cpu")


def clip_grad_value_(parameters: Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient of ``parameters`` to ``[-clip_value, clip_value]``
    (elementwise, tensor by tensor: no collective)."""
    for grads in _groups(parameters):
        for grad in grads:
            grad.clamp_(-clip_value, clip_value)
