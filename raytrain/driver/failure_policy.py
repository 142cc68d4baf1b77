"""What the driver does when a worker group fails: a pure policy, with no Ray in it.

Ray Train's controller asks a failure policy, after each worker-group failure, whether to
retry or to raise. raytrain's answer (``FailurePolicy.decide``), on the workers' own
exceptions:

- a non-finite loss (``NonFiniteLossError`` on any rank, or wrapped by any) is never
  retried: a retry from the last checkpoint would replay the same batches to the same NaN;
  nor is data that cannot be trained on (``BadDataError``: an image that does not decode),
  which a retry would read again;
- a loss spike (``LossSpikeError``: the ranks agreed on it, ``failure.spike``) is retried
  and not counted against ``max_failures``: the restart rolls back to the last checkpoint
  and skips the rows up to the spike (``worker.spike``), so it does not replay it; once
  ``max_rollbacks`` are spent the ranks raise ``LossSpikeLimitError``, never retried;
- workers that all stopped on a SIGTERM notice (``PreemptedError``, raised once their
  checkpoint is committed) are a preemption: retried against ``failure.max_preemptions``,
  as Ray does for a node drained for preemption, and not counted against ``max_failures``;
  unless the driver asked the run to stop (``requested()``: SIGUSR1 to ``raytrain run``,
  ``driver.preempt_request``): then it is raised, and the run ends at that checkpoint;
- a fault ``failure.chaos`` injected (``injected()`` claims it: the driver's
  ``chaos.ChaosClaim``) is retried and not counted against ``max_failures``: it tests
  recovery, it says nothing of the run;
- anything else is Ray's own decision (``DEFER``), which counts it against ``max_failures``.

``_compat.ray_train.PolicyAdapter`` puts it in front of Ray's default policy. Each failure
it is asked about is also told to ``notify`` (the driver's status record: why the workers
restart), in one line.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable

from raytrain.errors import (
    BadDataError,
    LossSpikeError,
    LossSpikeLimitError,
    NonFiniteLossError,
    PreemptedError,
    causes,
    wraps,
)

logger = logging.getLogger(__name__)


class Decision(enum.Enum):
    RAISE = "RAISE"
    RETRY = "RETRY"
    DEFER = "DEFER"  # Ray's default policy decides (and counts the failure)


class FailurePolicy:
    """raytrain's decisions on worker-group failures (see the module docstring);
    ``max_preemptions`` -1 is unlimited."""

    def __init__(
        self,
        max_preemptions: int,
        notify: Callable[[str], None] | None = None,
        injected: Callable[[], bool] | None = None,
        requested: Callable[[], bool] | None = None,
    ):
        self.max_preemptions = max_preemptions
        self.preemptions = 0
        self.notify = notify
        self.injected = injected
        self.requested = requested

    def decide(self, errors: Iterable[BaseException | None]) -> Decision:
        """The decision for a failure whose ranks raised ``errors`` (empty: the group died
        without a worker's exception, e.g. a lost node)."""
        errors = list(errors)
        if self.notify is not None:
            try:
                self.notify(describe_failure(errors))
            except Exception:  # a notice that cannot be sent never changes the decision
                logger.warning("the failure could not be told to the driver", exc_info=True)
        if any(
            wraps(error, NonFiniteLossError)
            or wraps(error, LossSpikeLimitError)
            or wraps(error, BadDataError)
            for error in errors
        ):
            return Decision.RAISE
        if any(wraps(error, LossSpikeError) for error in errors):
            logger.warning("loss spike: rolling back to the last checkpoint")
            return Decision.RETRY
        if self.injected is not None and self.injected():
            logger.warning("an injected fault (failure.chaos): restarting from the checkpoint")
            return Decision.RETRY
        if errors and all(wraps(error, PreemptedError) for error in errors):
            if self.requested is not None and self.requested():
                return Decision.RAISE  # the driver asked: stop at the committed checkpoint
            self.preemptions += 1
            if self.max_preemptions != -1 and self.preemptions > self.max_preemptions:
                return Decision.RAISE
            logger.warning(
                "preempted (%d so far): restarting from its checkpoint", self.preemptions
            )
            return Decision.RETRY
        return Decision.DEFER


def describe_failure(errors: list[BaseException | None]) -> str:
    """One line for a worker-group failure: each distinct error once (its type and the
    first line of its message), or what an empty list means."""
    lines: list[str] = []
    for error in errors:
        if error is None:
            continue
        *_, error = causes(error, limit=100)  # the worker's own error, not Ray's wrappers
        first = (str(error).strip().splitlines() or [""])[0][:200]
        line = f"{type(error).__name__}: {first}" if first else type(error).__name__
        if line not in lines:
            lines.append(line)
    if not lines:
        return "a worker died without raising (its process was killed, or its node lost)"
    return "; ".join(lines[:3]) + (f"; and {len(lines) - 3} more" if len(lines) > 3 else "")
