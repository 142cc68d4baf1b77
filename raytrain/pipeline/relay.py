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
from typing import Any

import torch


@dataclass
class Logged:
    """One name's values over a step's micro-batches, and the options its first call
    gave ``self.log``."""

    values: list[float] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)


class LogRelay:
    """Records ``module.log`` calls while ``recording``, and replays their means with
    ``publish`` on every rank of a pipeline."""

    def __init__(self) -> None:
        self.logged: dict[str, Logged] = {}

    def _record(self, name: str, value: Any, **options: Any) -> None:
        if not isinstance(value, (torch.Tensor, float, int, bool)):
            raise TypeError(
                f"self.log({name!r}, {type(value).__name__}): under pipeline parallelism "
                "(strategy.model_parallel.pipeline_parallel_size > 1) a step logs tensors "
                "or numbers, which raytrain sends from the last stage to every rank; log "
                "a torchmetrics object's compute() in an epoch-end hook instead"
            )
        number = float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else value
        entry = self.logged.setdefault(name, Logged(options=dict(options)))
        entry.values.append(float(number))

    @contextlib.contextmanager
    def recording(self, module: Any) -> Iterator[None]:
        """While inside, ``module.log(...)`` is recorded, not logged."""
        module.log = self._record
        try:
            yield
        finally:
            del module.log

    def take(self, rows: int) -> dict[str, tuple[float, dict[str, Any]]]:
        """The recorded names' means and options (a ``batch_size`` option becomes the
        whole batch's ``rows``: one log now stands for every micro-batch), cleared."""
        out = {}
        for name, entry in self.logged.items():
            options = dict(entry.options)
            if "batch_size" in options:
                options["batch_size"] = rows
            out[name] = (sum(entry.values) / len(entry.values), options)
        self.logged = {}
        return out

    @staticmethod
    def publish(module: Any, means: dict[str, tuple[float, dict[str, Any]]]) -> None:
        """Log ``means`` through ``module.log`` (every rank calls it with the same)."""
        for name, (value, options) in means.items():
            module.log(name, torch.tensor(value, device=module.device), **options)
