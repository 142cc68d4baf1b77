"""The gradients of a pipeline stage: held past Lightning's ``zero_grad``, and summed
over the stages for the parameters more than one stage holds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch import nn


class HeldGrads:
    """The gradients a schedule computed inside a training step, held until the step's
    backward: Lightning zeroes the gradients between the two (its closure runs the step,
    then ``zero_grad`` on the first batch of an accumulation, then the backward), which
    would drop them. ``before`` and ``after`` run around the schedule; ``apply`` adds what
    it computed, as a ``loss.backward()`` at that point would have."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.fresh: list[torch.Tensor | None] = []

    def _swap(self, grads: list[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        params = list(self.module.parameters())
        held = [p.grad for p in params]
        for param, grad in zip(params, grads or [None] * len(params), strict=True):
            param.grad = grad
        return held

    def before(self) -> list[torch.Tensor | None]:
        """Set every gradient aside (the schedule starts from none); returns them."""
        return self._swap(None)

    def after(self, before: list[torch.Tensor | None]) -> None:
        """Hold what the schedule computed, and put back what was set aside."""
        self.fresh = self._swap(before)

    def apply(self, scale: float = 1.0) -> None:
        """Add the held gradients, times ``scale``, to the parameters'. Lightning divides
        a step's loss by ``accumulate_grad_batches`` before its backward; the schedule
        backpropagated the loss whole, so its gradients are scaled here instead."""
        fresh, self.fresh = self.fresh, []
        for param, grad in zip(self.module.parameters(), fresh, strict=False):
            if grad is None:
                continue
            if scale != 1.0:
                grad.mul_(scale)
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad


class SharedParams:
    """Parameters more than one stage holds (a tied embedding and output head): each
    copy gets the sum of the copies' gradients, before the optimizer steps, as
    Megatron-LM keeps tied embeddings equal; and only the first stage holding one counts
    it in the gradient norm."""

    def __init__(
        self, module: nn.Module, group: dist.ProcessGroup, index: int, stages: int
    ) -> None:
        self.module, self.group, self.index, self.stages = module, group, index, stages
        self.kinds: dict[str, tuple[tuple[int, ...], str]] | None = None
        names = [name for name, _ in module.named_parameters()]
        held: list[list[str]] = [[] for _ in range(stages)]
        dist.all_gather_object(held, names, group=group)  # every stage's names
        self.owner: dict[str, int] = {}  # path: the first stage holding it
        for stage, stage_names in enumerate(held):
            for name in stage_names:
                if sum(name in other for other in held) > 1:
                    self.owner.setdefault(name, stage)

    def _param(self, name: str) -> torch.Tensor | None:
        try:
            return self.module.get_parameter(name)
        except AttributeError:
            return None

    def counted(self, param: torch.Tensor) -> bool:
        """Whether ``param`` counts in this stage's share of the gradient norm."""
        return not any(
            owner != self.index and self._param(name) is param for name, owner in self.owner.items()
        )

    def sync(self) -> None:
        """Sum each shared parameter's gradient over the pipeline; a stage that does not
        hold it (a middle stage) adds zeros of the holders' shape and type, which the
        stages tell each other at the first sync (after sharding, when they are known)."""
        if self.kinds is None:
            mine = {}
            for name in self.owner:
                param = self._param(name)
                if param is not None:
                    local = _local(param)
                    mine[name] = (tuple(local.shape), str(local.dtype).removeprefix("torch."))
            gathered: list[dict[str, Any]] = [{} for _ in range(self.stages)]
            dist.all_gather_object(gathered, mine, group=self.group)
            self.kinds = {k: v for stage in gathered for k, v in stage.items()}
        for name in sorted(self.owner):
            param = self._param(name)
            grad = None if param is None else param.grad
            if grad is not None:
                dist.all_reduce(_local(grad), group=self.group)
                continue
            shape, dtype = self.kinds[name]
            zeros = torch.zeros(shape, dtype=getattr(torch, dtype), device=_device(self.module))
            dist.all_reduce(zeros, group=self.group)


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
