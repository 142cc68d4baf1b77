"""What the driver does when a worker group fails: a pure policy, with no Ray in it.

Ray Train's controller asks a failure policy, after each worker-group failure, whether to
retry or to raise. raytrain's answer (``FailurePolicy.decide``), on the workers' own
exceptions:

- a non-finite loss (``NonFiniteLossError`` on any rank, or wrapped by any) is never
  retried: a retry from the last checkpoint would replay the same batches to the same NaN;
- workers that all stopped on a SIGTERM notice (``PreemptedError``, raised once their
  checkpoint is committed) are a preemption: retried against ``failure.max_preemptions``,
  as Ray does for a node drained for preemption, and not counted against ``max_failures``;
- anything else is Ray's own decision (``DEFER``), which counts it against ``max_failures``.

``_compat.ray_train.PolicyAdapter`` puts it in front of Ray's default policy.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable

from raytrain.errors import NonFiniteLossError, wraps
from raytrain.worker.preemption import PreemptedError

logger = logging.getLogger(__name__)


class Decision(enum.Enum):
    RAISE = "RAISE"
    RETRY = "RETRY"
    DEFER = "DEFER"  # Ray's default policy decides (and counts the failure)


class FailurePolicy:
    """raytrain's decisions on worker-group failures (see the module docstring);
    ``max_preemptions`` -1 is unlimited."""

    def __init__(self, max_preemptions: int):
        self.max_preemptions = max_preemptions
        self.preemptions = 0

    def decide(self, errors: Iterable[BaseException | None]) -> Decision:
        """The decision for a failure whose ranks raised ``errors`` (empty: the group died
        without a worker's exception, e.g. a lost node)."""
        errors = list(errors)
        if any(wraps(error, NonFiniteLossError) for error in errors):
            return Decision.RAISE
        if errors and all(wraps(error, PreemptedError) for error in errors):
            self.preemptions += 1
            if self.max_preemptions != -1 and self.preemptions > self.max_preemptions:
                return Decision.RAISE
            logger.warning("preempted (%d so far): restarting from its checkpoint",
                           self.preemptions)  # fmt: skip
            return Decision.RETRY
        return Decision.DEFER
