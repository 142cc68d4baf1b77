"""The model's own steps as the pipeline's input and loss.

On the first stage the step runs until it calls ``self(x)``; that ``x`` (cut into
micro-batches along its first dimension) is the pipeline's input. On the last stage the
step runs once per micro-batch, on that micro-batch's rows of the batch, its ``self(...)``
answering with the pipeline's output for them; what it returns is the loss the schedule
backpropagates. So a model writes no pipeline code, and its loss, logging and metrics
are the ones it has without a pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import torch

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule


class _Called(BaseException):
    """Stops a step at its ``self(...)`` call, carrying the arguments (a BaseException:
    a step that wraps ``self(x)`` in ``except Exception`` does not swallow it)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.call = (args, kwargs)


@contextlib.contextmanager
def forward_as(module: torch.nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``module(...)`` calls ``forward`` while inside (an instance attribute over the
    class's ``forward``; whatever instance attribute was there before is put back)."""
    with instance_attribute(module, "forward", forward):
        yield


@contextlib.contextmanager
def instance_attribute(obj: object, name: str, value: object) -> Iterator[None]:
    """``obj.<name>`` is ``value`` while inside; after, the instance attribute it had
    (if any) is back, else the class's shows through again."""
    missing = object()
    had = vars(obj).get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, had)


def rows_of(batch: Any) -> int:
    """The rows in ``batch``: the first dimension of its first tensor (in a tensor, or a
    dict, list or tuple of them)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    items = list(batch.values()) if isinstance(batch, Mapping) else batch
    for item in items if isinstance(items, (list, tuple)) else []:
        if isinstance(item, (torch.Tensor, Mapping, list, tuple)):
            return rows_of(item)
    raise ValueError(f"a batch of {type(batch).__name__} holds no tensor to cut into micro-batches")


def take_rows(batch: Any, start: int, stop: int, rows: int) -> Any:
    """``batch`` with every tensor of ``rows`` rows cut to ``start:stop`` (dicts, lists
    and tuples followed; anything else as it is)."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() and batch.shape[0] == rows else batch
    if isinstance(batch, Mapping):
        return {k: take_rows(v, start, stop, rows) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        taken = [take_rows(v, start, stop, rows) for v in batch]
        return taken if isinstance(batch, list) else tuple(taken)
    return batch


class ModelSteps:
    """One batch's step (``training_step`` or ``validation_step``) as the pipeline's
    input (``input``) and loss function (``loss``)."""

    def __init__(self, module: LightningModule) -> None:
        self.module = module
        self._batch: tuple[Any, int, Callable[..., Any]] | None = None
        self._probes = 0  # loss calls still to come that only infer shapes

    @contextlib.contextmanager
    def on(
        self, batch: Any, batch_idx: int, step_fn: Callable[..., Any], probes: int = 0
    ) -> Iterator[None]:
        """While inside, ``loss`` runs ``step_fn`` on ``batch``'s rows, but for its first
        ``probes`` calls: a new schedule's first training step first calls the loss once
        on a stand-in output (torch infers the gradients' shapes from it), which must
        not run the model's step (it would log and update metrics with it)."""
        self._batch, self._probes = (batch, batch_idx, step_fn), probes
        try:
            yield
        finally:
            self._batch = None

    def input(self, step_fn: Callable[..., Any], batch: Any, batch_idx: int) -> tuple[Any, ...]:
        """The arguments ``step_fn`` gives ``self(...)`` for ``batch``."""
        name = f"{type(self.module).__name__}.{step_fn.__name__}"

        def called(*args: Any, **kwargs: Any) -> NoReturn:
            raise _Called(args, kwargs)

        with forward_as(self.module, called):
            try:
                step_fn(batch, batch_idx)
            except _Called as stop:
                args, kwargs = stop.call
            else:
                raise RuntimeError(
                    f"{name} never called self(...): under pipeline parallelism the first "
                    "stage finds the model's input by running the step until it calls "
                    "self(x), so the step must compute its output that way"
                )
        if kwargs or not args or not all(isinstance(a, torch.Tensor) for a in args):
            raise RuntimeError(
                f"{name} calls self(...) with {len(args)} positional and {len(kwargs)} "
                "keyword arguments; a pipeline's input is positional tensors"
            )
        rows = rows_of(batch)
        if any(a.shape[0] != rows for a in args):
            raise RuntimeError(
                f"{name} calls self(...) with {[tuple(a.shape) for a in args]}, whose first "
                f"dimension is not the batch's {rows} rows; a pipeline cuts the input and "
                "the batch into micro-batches along the same rows"
            )
        return args

    def loss(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function on the last stage: the step on the micro-batch's
        ``rows`` of the batch (the target torch cut into micro-batches as it cut the
        input), its ``self(...)`` answering ``output``."""
        assert self._batch is not None, "loss outside ModelSteps.on"
        if self._probes:
            self._probes -= 1
            return output.float().sum() * 0.0  # on the output's graph, of no value
        batch, batch_idx, step_fn = self._batch
        part = take_rows(batch, int(rows[0]), int(rows[-1]) + 1, rows_of(batch))
        with forward_as(self.module, lambda *args, **kwargs: output):
            result = step_fn(part, batch_idx)
        if isinstance(result, Mapping):
            result = result.get("loss")
        if result is None:  # a validation step returns nothing; a training step may skip
            return output.float().sum() * 0.0  # on the output's graph, for the backward
        return result
