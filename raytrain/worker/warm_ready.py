"""Imported last by a warm worker process (``driver.warm_pool.PRELOAD``): marks the process
as ready, every module before it imported, by creating a file named by its process id in
``$RAYTRAIN_WARM_DIR``. A process that is idle but still importing would make the first
run wait for it; ``WarmPool.wait_ready`` counts only marked ones. Without the variable
(a cluster raytrain did not start) it does nothing."""

from __future__ import annotations

import os

from raytrain.contract import WARM_DIR_ENV  # imported already: ``worker.loop`` comes first


def _mark() -> None:
    folder = os.environ.get(WARM_DIR_ENV)
    if folder:
        try:
            with open(os.path.join(folder, str(os.getpid())), "w"):
                pass
        except OSError:  # the folder went with its cluster: nothing to mark
            pass


_mark()
