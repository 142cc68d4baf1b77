"""The worker side's one door: the two functions the driver hands Ray Train, and the only
names of ``worker/`` the driver imports (``tests/unit/test_boundaries.py`` holds it so).
Ray Train pickles them by reference; importing this module costs the driver nothing: it
imports no torch, no Lightning, no other module of ``worker/``.

- ``train_loop``: every worker's ``train_loop_per_worker`` (``worker.loop.train``).
- ``on_group_start``: run on each worker's main thread as its group starts (Ray Train's
  worker-group callback): a SIGTERM becomes a preemption notice (``worker.preemption``).
"""

from __future__ import annotations

import time
from typing import Any


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train's ``train_loop_per_worker``: train the job of the ``WorkerConfig`` in
    ``config`` (see ``raytrain.contract``)."""
    entered = time.time()  # before the imports: the worker's start is timed from here
    from raytrain.worker.loop import train

    train(config, entered)


def on_group_start() -> None:
    """Make a SIGTERM to this worker process a preemption notice (main thread only)."""
    from raytrain.worker.preemption import install_sigterm_notice

    install_sigterm_notice()
