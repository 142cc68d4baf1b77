"""What the model's steps log under a pipeline, made known to every rank.

Only the last stage runs the model's ``training_step`` and ``validation_step`` in full
(once per micro-batch, inside the schedule), so only it would log; but rank 0, which is on
the first stage, is the rank whose metrics raytrain reports and Lightning's checkpoint
monitor reads, and a ``sync_dist`` log is a collective every rank must join. So while the
schedule runs, ``self.log`` (and ``log_dict``, which calls it) is recorded instead; after
it, the last stage sends each name's mean over the micro-batches to the pipeline's other
ranks, and every rank logs it once, with the options the model gave it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from raytrain.pipeline.model_steps import instance_attribute

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule


@dataclass
class Logged:
    """One name's values over a step's micro-batches (or the path of the torchmetrics
    metric it logs), and the options its first call gave ``self.log``."""

    values: list[float] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    metric: str | None = None


class LogRelay:
    """Records ``module.log`` calls while ``recording``, and replays their means with
    ``publish`` on every rank of a pipeline.

    A torchmetrics metric the model logs is relayed by its path in the model: every
    rank logs its own copy, which only the last stage updated, and Lightning's epoch-end
    ``compute`` sums the copies' states over the ranks (a copy never updated adds
    nothing), as it sums data-parallel replicas'."""

    def __init__(self) -> None:
        self.logged: dict[str, Logged] = {}
        self.module: Any = None

    def _record(self, name: str, value: object, **options: Any) -> None:
        entry = self.logged.setdefault(name, Logged(options=dict(options)))
        if isinstance(value, torch.Tensor):
            entry.values.append(float(value.detach().float().mean()))
        elif isinstance(value, (float, int, bool)):
            entry.values.append(float(value))
        else:
            entry.metric = self._path(name, value)

    def _path(self, name: str, value: object) -> str:
        for path, sub in self.module.named_modules():
            if sub is value and path:
                return str(path)
        raise TypeError(
            f"self.log({name!r}, {type(value).__name__}): under pipeline parallelism "
            "(strategy.model_parallel.pipeline_parallel_size > 1) a step logs tensors, "
            "numbers, or a torchmetrics metric that is an attribute of the model, which "
            "raytrain relays from the last stage to every rank"
        )

    @contextlib.contextmanager
    def recording(self, module: LightningModule) -> Iterator[None]:
        """While inside, ``module.log(...)`` is recorded, not logged."""
        self.module = module
        with instance_attribute(module, "log", self._record):
            yield

    def take(self, rows: int) -> dict[str, tuple[float | str, dict[str, Any]]]:
        """The recorded names' means (or metric paths) and options (a ``batch_size``
        option becomes the whole batch's ``rows``: one log now stands for every
        micro-batch), cleared."""
        out: dict[str, tuple[float | str, dict[str, Any]]] = {}
        for name, entry in self.logged.items():
            options = dict(entry.options)
            if "batch_size" in options:
                options["batch_size"] = rows
            if entry.metric is not None:
                out[name] = (entry.metric, options)
            else:
                out[name] = (sum(entry.values) / len(entry.values), options)
        self.logged = {}
        return out

    @staticmethod
    def publish(module: Any, logged: dict[str, tuple[float | str, dict[str, Any]]]) -> None:
        """Log ``logged`` through ``module.log`` (every rank calls it with the same)."""
        for name, (value, options) in logged.items():
            if isinstance(value, str):
                module.log(name, module.get_submodule(value), **options)
            else:
                module.log(name, torch.tensor(value, device=module.device), **options)
