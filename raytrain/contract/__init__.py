"""The typed contract between the driver and its workers, both directions.

- ``worker_config``: what the driver hands every worker (``WorkerConfig``, the data sets).
- ``events``: what a worker sends the driver (``Report``, ``TimelineWindow``,
  ``HangReport``, ``RollbackNotice``, ``FailureNotice``) and the ``RunListener`` that
  hears them.

Nothing here imports Ray, torch or Lightning: both sides import it.
"""

from raytrain.contract.events import (
    SCORE_KEY,
    Event,
    FailureNotice,
    HangReport,
    Publish,
    Report,
    RollbackNotice,
    RunListener,
    Startup,
    TimelineWindow,
    deliver,
)
from raytrain.contract.worker_config import (
    CONFIG_KEY,
    WARM_DIR_ENV,
    CachedSet,
    ImageSet,
    MixedSet,
    StreamedSet,
    WorkerConfig,
)

__all__ = [
    "CONFIG_KEY",
    "SCORE_KEY",
    "WARM_DIR_ENV",
    "CachedSet",
    "Event",
    "FailureNotice",
    "HangReport",
    "ImageSet",
    "MixedSet",
    "Publish",
    "Report",
    "RollbackNotice",
    "RunListener",
    "Startup",
    "StreamedSet",
    "TimelineWindow",
    "WorkerConfig",
    "deliver",
]
