"""Preemption notices in the worker processes: a SIGTERM, or Ray's signal that a node drains.

A cloud takes a spot node back after a notice: a SIGTERM to the processes (Kubernetes,
most schedulers), or a Ray node drain with reason PREEMPTION and a deadline (Ray's
autoscaler; Ray Train's preemption watcher tells every worker). Either way the workers have
a grace window to save their work. A third notice comes from the driver: ``raytrain run``
sent SIGUSR1 (a Slurm job whose time ends, ``driver.preempt_request``) sets a flag on the
run's event sink, which rank 0 reads at each check (``watch_requests``); the run then stops
at that checkpoint instead of restarting.

Ray's own SIGTERM handler in a worker process exits at once, which is a plain worker
failure: charged to ``max_failures``, with everything since the last checkpoint lost.
``install_sigterm_notice`` (run by a Ray Train worker-group callback, see
``driver.trainer``) replaces it in every training worker, on the actor's main thread where
Python allows signal handlers, with one that only records the notice while training runs.
``guards.PreemptionGuard`` polls ``notice()`` in the train loop, agrees on it across ranks,
saves a checkpoint and waits for Ray to commit it; after a SIGTERM it then raises
``errors.PreemptedError``, which the failure policy retries against ``failure.max_preemptions``,
not ``max_failures``.

This module imports neither Lightning nor torch: the controller unpickles the callback
that names ``install_sigterm_notice``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType

    from ray.train.v2.api.preemption import PreemptionInfo

_sigterm = threading.Event()
_training = threading.Event()
# rank 0's reader of the driver's request (None on the other ranks: the guard's all-reduce
# shares what rank 0 saw)
_requested: list[Callable[[], bool]] = []


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if _training.is_set() and not _sigterm.is_set():
        _sigterm.set()  # the train loop checkpoints and stops within its grace window
        return
    # not training, or a second SIGTERM: leave as Ray's own handler does
    raise SystemExit(1)


def install_sigterm_notice() -> None:
    """Make a SIGTERM to this process a preemption notice (main thread only)."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def training(active: bool) -> None:
    """Whether the train loop is running, and so will act on a SIGTERM notice."""
    if active:
        _training.set()
    else:
        _training.clear()


def sigterm_received() -> bool:
    """Whether this process got a SIGTERM notice while training."""
    return _sigterm.is_set()


def watch_requests(reader: Callable[[], bool] | None) -> None:
    """Read the driver's stop request with ``reader`` at each check (rank 0), or not."""
    _requested[:] = [reader] if reader is not None else []


def ray_preemption_info() -> PreemptionInfo | None:
    """Ray Train's preemption info for this worker (a node of the group drains for a
    preemption), or None. Read locally: no barrier, unlike ``ray.train.get_preemption_info``."""
    from raytrain._compat.ray_train import worker_preemption_info

    return worker_preemption_info()


def notice() -> str | None:
    """This worker's preemption notice, if any: ``"SIGTERM"``, ``"requested"`` (by the
    driver) or ``"node drain"``."""
    if sigterm_received():
        return "SIGTERM"
    if any(read() for read in _requested):
        return "requested"
    if ray_preemption_info() is not None:
        return "node drain"
    return None
