"""Following a submitted job, and submitting its spec again when the job is lost to the
cluster rather than failed by the run: ``raytrain submit --supervise``.

Ray restarts neither a job's driver nor a head, and a new head has no job table: a job
whose driver died, or whose head went, is gone for good. The run itself is not: its
checkpoints, its run state and its MLflow run are in the run's storage, and ``raytrain run``
of the same spec resumes from the last committed checkpoint, takes the dead driver's lease
over and continues the MLflow run as its next attempt. So the supervisor only has to tell
the two kinds of end apart (``classify``, a pure function over what Ray and the run's
status record say, see its docstring), wait for the head's job server to answer again, and
submit the same spec again, within a budget (``ResubmitPolicy``).

A failure that is the run's own verdict (an exception in the user's code after the
spec's ``failure.max_failures`` restarts, a NaN stop, bad input) is never resubmitted: the
same spec would meet it again.
"""

from __future__ import annotations

import enum
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raytrain.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, RaytrainError
from raytrain.submit.client import TERMINAL, JobHandle, again_id, submit
from raytrain.submit.connection import JobsError, JobUnknown, ServerUnreachable, TokenRefused
from raytrain.util.redaction import redact
from raytrain.util.terminal import printable

if TYPE_CHECKING:
    from ray.job_submission import JobDetails

    from raytrain.records.run_status import RunStatus

# The supervisor's exit code when it gave up on the cluster: the resubmission budget was
# spent, or the head did not come back in time. 1 and 2 keep their meaning (the run
# failed; bad input).
EXIT_INFRASTRUCTURE = 3

# Ray's JobErrorType values that say the job's driver was never the one to fail: its
# supervisor actor died or could not start or be placed, or its command could not start.
_RAY_SIDE_ERRORS = frozenset(
    {
        "JOB_SUPERVISOR_ACTOR_DIED",
        "JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE",
        "JOB_SUPERVISOR_ACTOR_START_TIMEOUT",
        "JOB_SUPERVISOR_ACTOR_START_FAILURE",
        "JOB_SUPERVISOR_ACTOR_UNSCHEDULABLE",
        "JOB_ENTRYPOINT_COMMAND_START_ERROR",
    }
)


class EndKind(enum.Enum):
    """How a supervised job ended."""

    SUCCEEDED = "succeeded"
    BAD_INPUT = "bad input"
    USER_CODE = "user code"  # an exception in the workers, after max_failures restarts
    NON_FINITE = "non-finite loss"
    SPIKE_LIMIT = "loss spikes"  # failure.spike.max_rollbacks spent
    WORKERS_LOST = "workers lost"  # the workers died (not raised) past max_failures
    PREEMPTED = "preempted"  # stopped at a committed checkpoint on request (SIGUSR1)
    RUN_FAILED = "run failed"  # the driver failed by itself, for another reason
    STOPPED = "stopped"  # someone stopped the job (`raytrain stop`, `ray job stop`)
    SETUP_FAILED = "setup failed"  # the job's runtime environment could not be set up
    DRIVER_LOST = "driver lost"  # killed by a signal, or Ray's side of the job failed
    LOST_WITH_HEAD = "lost with the head"  # the head that answers does not know the job


@dataclass(frozen=True)
class JobEnd:
    """What is known of a job that ended (or vanished): Ray's ``JobDetails`` fields and the
    run's status record, reduced to what ``classify`` reads.

    ``status`` None: the head answers and does not know the job. ``record_state`` and
    ``record_failure`` are from the run's status record when it was written by this job's
    driver (started after the job did), else None."""

    status: str | None
    error_type: str | None = None
    driver_exit_code: int | None = None
    message: str = ""
    record_state: str | None = None
    record_failure: str | None = None
    record_error: str | None = None


@dataclass(frozen=True)
class Verdict:
    """``classify``'s answer: the kind, whether to submit again, the exit code if not."""

    kind: EndKind
    resubmit: bool
    exit_code: int
    reason: str


# The kinds of failure a driver that ended by itself records (``run_status.FailureKind``),
# beside bad input: (what the end is, whether to submit again, why).
_RECORDED_VERDICTS: dict[str, tuple[EndKind, bool, str]] = {
    "non_finite": (
        EndKind.NON_FINITE,
        False,
        "the loss was not finite (NaN or inf); resuming would replay the same batches",
    ),
    "spike_limit": (
        EndKind.SPIKE_LIMIT,
        False,
        "the loss spiked with failure.spike.max_rollbacks spent",
    ),
    "infrastructure": (
        EndKind.WORKERS_LOST,
        True,
        "the workers were lost (their processes or nodes died, or preempted) "
        "beyond the spec's failure limits",
    ),
    "preempted": (
        EndKind.PREEMPTED,
        True,
        "the run stopped at a committed checkpoint on request (SIGUSR1 to its driver)",
    ),
    "workers": (
        EndKind.USER_CODE,
        False,
        "user code: the workers raised, and the spec's failure.max_failures restarts were used",
    ),
}


def _signalled(code: int | None) -> bool:
    """Whether an exit code is a signal's: negative from Python's subprocess, 128+N from a
    shell between Ray and the driver."""
    return code is not None and (code < 0 or 128 < code < 160)


def classify(end: JobEnd) -> Verdict:
    """Whether a job's end is the run's own verdict (kept) or a loss to the cluster
    (resubmitted).

    The rule: a driver that ended by itself decided; a driver that did not, did not.

    - SUCCEEDED: done. STOPPED: someone asked; not resubmitted.
    - Unknown to a head that answers (``status`` None): the head went and came back
      without its job table: resubmitted.
    - FAILED with a driver exit code from a signal (negative, or 128+N from a shell): the
      driver was killed (OOM, a lost node): resubmitted.
    - FAILED because Ray's side of the job failed (its supervisor actor died or did not
      start, the command did not start) and no status record of this job says ``failed``:
      resubmitted.
    - FAILED with the runtime environment not set up (a ``--pip`` package, the working
      dir): not resubmitted, as it would fail the same way.
    - FAILED with any other exit code: the driver ended by itself. Exit 2 (or a record
      ``bad_input``) is bad input; otherwise the status record's ``failure`` names the
      kind: ``non_finite``, ``spike_limit``, ``workers`` (the user's code raised, after
      the ``failure.max_failures`` restarts): not resubmitted; ``infrastructure`` (the
      workers only died: processes or nodes lost, preemptions past their budget):
      resubmitted, the resumed run gets its failure budget again; ``preempted`` (stopped at
      a committed checkpoint on request): resubmitted.
    - FAILED with neither an exit code nor a Ray-side error type (an older Ray): the status
      record decides; ``failed`` is the run's verdict, any other state a dead driver.
    """
    if end.status is None:
        return Verdict(
            EndKind.LOST_WITH_HEAD,
            True,
            EXIT_INFRASTRUCTURE,
            "the head does not know the job: it was restarted without it",
        )
    if end.status == "SUCCEEDED":
        return Verdict(EndKind.SUCCEEDED, False, EXIT_OK, "the job succeeded")
    if end.status == "STOPPED":
        return Verdict(EndKind.STOPPED, False, EXIT_FAILED, "the job was stopped")
    return _not_its_own(end) or _its_own(end)


def _not_its_own(end: JobEnd) -> Verdict | None:
    """A FAILED job's end that its driver did not decide (killed, lost by Ray, never set
    up); None: the driver ended by itself."""
    code, said_failed = end.driver_exit_code, end.record_state == "failed"
    if _signalled(code):
        return Verdict(
            EndKind.DRIVER_LOST,
            True,
            EXIT_INFRASTRUCTURE,
            f"the job's driver was killed (exit code {code})",
        )
    if end.error_type in _RAY_SIDE_ERRORS and not said_failed:
        return Verdict(
            EndKind.DRIVER_LOST,
            True,
            EXIT_INFRASTRUCTURE,
            f"Ray lost the job's driver ({end.error_type})",
        )
    if end.error_type == "RUNTIME_ENV_SETUP_FAILURE":
        return Verdict(
            EndKind.SETUP_FAILED,
            False,
            EXIT_FAILED,
            "the job's runtime environment could not be set up (--pip, "
            "--working-dir); the same submission would fail the same way",
        )
    if code is None and not said_failed:
        return Verdict(
            EndKind.DRIVER_LOST,
            True,
            EXIT_INFRASTRUCTURE,
            "the job failed and its driver left no final status record",
        )
    return None


def _its_own(end: JobEnd) -> Verdict:
    """The verdict of a driver that ended by itself: its exit code and status record."""
    detail = f" ({end.record_error})" if end.record_error else ""
    code = end.driver_exit_code
    if code == EXIT_BAD_INPUT or end.record_failure == "bad_input":
        why = f"bad input: the job's driver refused the spec or its run{detail}"
        return Verdict(EndKind.BAD_INPUT, False, EXIT_BAD_INPUT, why)
    if end.record_failure in _RECORDED_VERDICTS:
        kind, resubmit, why = _RECORDED_VERDICTS[end.record_failure]
        return Verdict(
            kind, resubmit, EXIT_INFRASTRUCTURE if resubmit else EXIT_FAILED, why + detail
        )
    return Verdict(
        EndKind.RUN_FAILED,
        False,
        EXIT_FAILED,
        f"the job's driver failed by itself (exit code {code}){detail}",
    )


@dataclass(frozen=True)
class ResubmitPolicy:
    """How many times to submit again, how long to wait between, and how long to wait for
    a head's job server to answer. Backoff doubles from ``backoff_s`` up to
    ``max_backoff_s``: a head that is coming back is asked often at first, one that is
    being rebuilt (a new machine, a pod rescheduled) is not hammered."""

    max_resubmits: int = 3
    backoff_s: float = 2.0
    max_backoff_s: float = 30.0
    head_wait_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_resubmits < 0:
            raise SupervisionError(
                [f"--max-resubmits {self.max_resubmits}: must be 0 or more"], EXIT_BAD_INPUT
            )
        if not math.isfinite(self.head_wait_s) or self.head_wait_s <= 0:
            raise SupervisionError(
                [f"--head-wait {self.head_wait_s:g}: must be more than 0 seconds"],
                EXIT_BAD_INPUT,
            )

    def delay(self, tries: int) -> float:
        """Seconds to wait before try number ``tries`` (1 for the first wait)."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, tries - 1))

    def allows(self, resubmits: int) -> bool:
        """Whether another resubmission is in the budget after ``resubmits`` of them."""
        return resubmits < self.max_resubmits


class SupervisionError(RaytrainError):
    """A supervised job ended without success; ``exit_code`` says which kind (1: the run
    failed by itself, 2: bad input, 3: the cluster was given up on), ``result`` what was
    seen."""

    def __init__(self, problems: list[str], exit_code: int, result: Supervised | None = None):
        super().__init__(problems)
        self.exit_code = exit_code
        self.result = result


@dataclass
class Supervised:
    """A supervised job's story: every Ray job id submitted for it, in order, and how the
    last one ended."""

    job_ids: list[str] = field(default_factory=list)
    verdict: Verdict | None = None
    handle: JobHandle | None = None

    @property
    def resubmits(self) -> int:
        return max(0, len(self.job_ids) - 1)


def _say(text: str) -> None:
    print(f"raytrain: {printable(text)}", file=sys.stderr, flush=True)


class Supervisor:
    """Follows a job and submits its spec again after a loss (see the module docstring).

    ``submit(again)`` submits the spec and returns its handle (``again``: a resubmission;
    ``ServerUnreachable`` while the head is down). It and ``sleep``/``clock``/``say`` are
    parameters so that a unit test drives the loop without a cluster."""

    def __init__(
        self,
        submit: Callable[[bool], JobHandle],
        policy: ResubmitPolicy,
        *,
        poll_s: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = _say,
    ):
        self._submit, self.policy = submit, policy
        self.poll_s, self._sleep, self._clock, self._say = poll_s, sleep, clock, say

    def run(self, first: JobHandle) -> Supervised:
        """Follow ``first`` (submitted already) and its resubmissions to the end; returns
        the story when the job succeeded, raises ``SupervisionError`` otherwise."""
        story = Supervised(job_ids=[first.job_id], handle=first)
        handle = first
        while True:
            end = self._watch(handle)
            verdict = classify(end)
            story.verdict = verdict
            if verdict.kind is EndKind.SUCCEEDED:
                self._say(
                    f"job {handle.job_id} succeeded"
                    + (f" after {story.resubmits} resubmission(s)" if story.resubmits else "")
                )
                return story
            if not verdict.resubmit:
                raise SupervisionError(
                    [
                        f"job {handle.job_id} failed, {verdict.kind.value}: {verdict.reason}; "
                        "not resubmitted"
                    ],
                    verdict.exit_code,
                    story,
                )
            if not self.policy.allows(story.resubmits):
                raise SupervisionError(
                    [
                        f"job {handle.job_id} was lost ({verdict.reason}) and the budget of "
                        f"{self.policy.max_resubmits} resubmission(s) is spent (--max-resubmits)"
                    ],
                    EXIT_INFRASTRUCTURE,
                    story,
                )
            self._sleep(self.policy.delay(story.resubmits + 1))
            handle = self._resubmit(handle.job_id, verdict, story)
            story.job_ids.append(handle.job_id)
            story.handle = handle

    def _resubmit(self, lost: str, verdict: Verdict, story: Supervised) -> JobHandle:
        """Submit again once the head's job server takes a submission."""
        number = story.resubmits + 1
        handle = self._until_up(lambda: self._submit(True), f"resubmission {number}")
        self._say(
            f"resubmitted job {lost} as {handle.job_id} ({number} of "
            f"{self.policy.max_resubmits}): {verdict.reason}"
        )
        return handle

    def _until_up(self, call: Callable[[], Any], what: str) -> Any:
        """``call()``, tried again with backoff while the job server does not answer (or
        answers, but not yet as a working server would); a refused token is raised at once.
        Gives up after ``policy.head_wait_s``."""
        started, tries, said = self._clock(), 0, False
        while True:
            try:
                return call()
            except TokenRefused:
                raise
            except (ServerUnreachable, JobsError) as exc:
                if isinstance(exc, JobsError) and not _transient(exc):
                    raise
                waited = self._clock() - started
                if waited >= self.policy.head_wait_s:
                    raise SupervisionError(
                        [
                            f"{what}: the head's job server did not answer for {waited:.0f}s "
                            f"(--head-wait {self.policy.head_wait_s:g}); gave up: {exc}"
                        ],
                        EXIT_INFRASTRUCTURE,
                    ) from None
                if not said:
                    self._say(f"waiting for the head's job server ({exc})")
                    said = True
                tries += 1
                self._sleep(
                    min(self.policy.delay(tries), max(0.0, self.policy.head_wait_s - waited))
                )

    def _watch(self, handle: JobHandle) -> JobEnd:
        """Poll the job until it ends, or the head that answers does not know it."""
        while True:
            try:
                info = self._until_up(handle.info, f"following job {handle.job_id}")
            except JobUnknown:
                return JobEnd(status=None)
            status = str(info.status.value)
            if status in TERMINAL:
                return job_end(info, _record(handle, info))
            self._sleep(self.poll_s)


def _transient(exc: JobsError) -> bool:
    """Whether a job server's error is one of a server not answering yet: unreachable, or
    an HTTP 5xx from a dashboard whose job agent is still starting."""
    if isinstance(exc, ServerUnreachable):
        return True
    if isinstance(exc, JobUnknown | TokenRefused):
        return False
    text = str(exc)
    return any(f"status code {c}" in text or f" {c} " in text for c in (500, 502, 503, 504))


def _record(handle: JobHandle, info: JobDetails) -> RunStatus | None:
    """The run's status record when this job's driver wrote it (it started after the job
    was submitted); None when it cannot be read from here, or is an earlier driver's."""
    try:
        status = handle.progress()
    except RaytrainError:
        return None
    start_ms = getattr(info, "start_time", None)
    if status is None or (start_ms and status.started_at < start_ms / 1000 - 1):
        return None
    return status


def job_end(info: JobDetails, record: RunStatus | None) -> JobEnd:
    """``JobEnd`` from Ray's ``JobDetails`` and the run's status record."""
    error_type = getattr(info, "error_type", None)
    return JobEnd(
        status=str(info.status.value),
        error_type=getattr(error_type, "value", error_type),
        driver_exit_code=getattr(info, "driver_exit_code", None),
        message=redact(info.message or "")[-2000:],
        record_state=record.state if record else None,
        record_failure=record.failure if record else None,
        record_error=redact(record.error)[:300] if record and record.error else None,
    )


def supervise(
    spec: str | os.PathLike[str],
    overrides: Iterable[str] = (),
    *,
    max_resubmits: int = 3,
    head_wait_s: float = 600.0,
    **options: Any,
) -> JobHandle:
    """Submit the job spec at ``spec`` as ``client.submit`` does (``options`` are its
    keyword arguments), follow it to its end, and return the handle of the job that
    succeeded (``earlier``: the ids of those it resubmitted).

    A job lost to the cluster (its driver died, its head went and came back without it) is
    submitted again, the same spec and overrides, once the head's job server answers
    (waited for up to ``head_wait_s`` seconds, with backoff), at most ``max_resubmits``
    times; the run resumes from its last committed checkpoint. A failure of the run itself
    (user code, NaN, bad input) is not; any end but success raises ``SupervisionError``,
    whose ``exit_code`` says which kind."""
    policy = ResubmitPolicy(max_resubmits=max_resubmits, head_wait_s=head_wait_s)
    overrides = list(overrides)
    options["env"] = dict(options.get("env") or {})
    job_id = options.pop("job_id", None)

    def again(resubmit: bool) -> JobHandle:
        # a resubmission resumes: never --fresh again; --force, as the lost driver's lease
        # may look live from another host for up to lease.STALE_S
        return submit(
            spec,
            overrides,
            **{
                **options,
                "job_id": again_id(job_id) if job_id and resubmit else job_id,
                "fresh": options.get("fresh", False) and not resubmit,
                "force": options.get("force", False) or resubmit,
                "warn": options.get("warn", True) and not resubmit,
            },
        )

    first = again(False)
    print(
        printable(f"raytrain: supervising job {first.job_id} on {first.server.address}"),
        file=sys.stderr,
        flush=True,
    )
    story = Supervisor(again, policy).run(first)
    assert story.handle is not None
    story.handle.earlier = tuple(story.job_ids[:-1])
    return story.handle
