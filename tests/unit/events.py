"""Rank 0's reports as the workers build them, for the driver's listeners in unit tests."""

from __future__ import annotations

from typing import Any

from raytrain.contract import Report, Startup


def report(
    step: int, epoch: int = 0, kind: str = "step", world_size: int = 2, **rest: Any
) -> Report:
    """A ``Report``: ``rest`` holds its metrics, and any of its own fields by name
    (``checkpoint``, ``stopped``, ``startup``, ...); ``started=`` gives it a ``Startup``
    (a worker group's first report) resumed at that step."""
    own = {k: rest.pop(k) for k in list(rest) if k in Report.__dataclass_fields__}
    started = rest.pop("started", None)
    if started is not None:
        own["startup"] = Startup(marks={}, resumed_step=int(started), precision="32-true (test)")
    return Report(step=step, epoch=epoch, kind=kind, world_size=world_size, metrics=rest, **own)
