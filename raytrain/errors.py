"""The errors raytrain raises for problems a user can fix, and their exit codes.

Every user-facing failure is one of these types. Each carries a list of problems, one line
each, naming what to fix (a field path, a file, a URI), so the CLI can print them and exit
with a code that scripts can test for.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from raytrain.util.redaction import redact

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
# A run stopped on request at a committed checkpoint (SIGUSR1 to ``raytrain run``: a Slurm
# job's time is ending): the same command resumes it. ``submit --supervise`` has 3.
EXIT_PREEMPTED = 4


class RaytrainError(Exception):
    """Base of raytrain's user-facing errors; ``exit_code`` is what the CLI exits with."""

    exit_code: int = EXIT_FAILED
    # the message was printed when it happened: the CLI only exits with ``exit_code``
    said: bool = False

    def __init__(self, problems: str | Iterable[str]):
        # every message is printed, and may be logged or recorded: never with a credential
        lines = [problems] if isinstance(problems, str) else list(problems)
        self.problems: list[str] = [redact(str(line)) for line in lines]
        super().__init__("\n".join(self.problems))


class SpecError(RaytrainError):
    """The job spec is malformed or names something that does not exist (bad input)."""

    exit_code = EXIT_BAD_INPUT


class StorageError(RaytrainError):
    """A storage URI cannot be read or written."""

    exit_code = EXIT_BAD_INPUT


class RecordUnreadable(StorageError, ValueError):
    """A record's bytes cannot be one (not UTF-8 text, larger than any raytrain writes).
    A ``ValueError`` too, as a decoding error was: each reader's own handling of a damaged
    record applies (the run state's "pass --fresh", ...)."""


class RunStateError(RaytrainError):
    """The run's recorded state conflicts with what was asked (e.g. a changed spec)."""

    exit_code = EXIT_BAD_INPUT


class TrackingError(RaytrainError):
    """The MLflow tracking store named by the spec (or the environment) cannot be used."""

    exit_code = EXIT_BAD_INPUT


class TrackingUnreachable(TrackingError):
    """The tracking server does not answer (refused, or silent past the timeout): nothing in
    the input need be wrong, so this is a failure, not bad input."""

    exit_code = EXIT_FAILED


class NonFiniteLossError(RuntimeError):
    """Raised in the workers when the loss or its gradients are NaN/Inf; never retried."""


class BadDataError(RuntimeError):
    """Raised in the workers for data no retry can train on (an image that does not decode,
    images of different shapes in a batch); never retried. The message names the file."""


class LossSpikeError(RuntimeError):
    """Raised in the workers when they agree the loss spiked (``failure.spike``): the run is
    retried from its last checkpoint, skipping the rows up to the spike."""


class LossSpikeLimitError(RuntimeError):
    """Raised in the workers at a spike once ``failure.spike.max_rollbacks`` are spent;
    never retried."""


class PreemptedError(RuntimeError):
    """Raised on every rank after a SIGTERM notice or the driver's request, once its
    checkpoint is committed (``worker.preemption``); the failure policy retries it against
    ``failure.max_preemptions``, unless the driver asked (then the run stops)."""


class TrainingFailed(RaytrainError):
    """Training started but did not finish; the message carries the worker's own error."""

    exit_code = EXIT_FAILED


class RunPreempted(TrainingFailed):
    """The run stopped because its driver was asked to (SIGUSR1, ``driver.preempt_request``):
    every rank saved and committed a checkpoint first, so the same command resumes it with
    nothing lost. A Slurm job requeues itself on this exit code."""

    exit_code = EXIT_PREEMPTED


class ClusterLost(RaytrainError):
    """The cluster ``raytrain up`` started went away during the run (``raytrain down``, or
    its server died). Nothing of the run is lost: the same command resumes it from its last
    committed checkpoint. ``driver.cluster_watch`` has printed the message already, the
    moment it noticed (``said``): the CLI does not print it twice."""

    exit_code = EXIT_FAILED
    said = True


class ClusterUnreachable(RaytrainError):
    """The cluster ``raytrain up`` recorded does not answer a run that joins it."""

    exit_code = EXIT_FAILED


class ModelNotRegistered(RaytrainError):
    """Training finished, but the model asked for by ``tracking.mlflow.register_as`` could
    not be logged or registered: a script that deploys it must not go on as if it were."""

    exit_code = EXIT_FAILED


def one_line(text: object, limit: int = 300) -> str:
    """``text`` (an error, a server's answer) as one line of at most ``limit`` characters:
    a 414 page or a traceback in it must not become the user's screenful."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


def causes(error: BaseException | None, limit: int = 10) -> Iterator[BaseException]:
    """``error`` and the errors it wraps, outermost first: a Ray task error's ``cause`` (the
    worker's own exception), else ``__cause__``. At most ``limit`` deep, and never round a
    loop: a chain that comes back to itself ends."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen and len(seen) < limit:
        seen.add(id(error))
        yield error
        error = getattr(error, "cause", None) or error.__cause__


def wraps(error: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether ``error`` is, or wraps, an error of type ``kind``. Matched by class name:
    a worker's exception can arrive as Ray's dual-typed copy of it."""
    return any(type(e).__name__ == kind.__name__ for e in causes(error))


def root_cause(error: BaseException) -> str:
    """The innermost error ``error`` wraps, as ``Type: message``."""
    *_, innermost = causes(error, limit=100)
    return f"{type(innermost).__name__}: {innermost}".strip()
