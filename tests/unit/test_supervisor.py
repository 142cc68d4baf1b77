"""The supervisor's policy: which job ends are submitted again (``classify``), the backoff
and budget (``ResubmitPolicy``), and the loop driven by fake submissions and a fake clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from raytrain.cli.app import main
from raytrain.errors import NonFiniteLossError, SpecError, TrainingFailed
from raytrain.records.status_record import failure_kind
from raytrain.submit.connection import JobsError, JobUnknown, ServerUnreachable, TokenRefused
from raytrain.submit.supervisor import (
    EXIT_INFRASTRUCTURE,
    EndKind,
    JobEnd,
    ResubmitPolicy,
    SupervisionError,
    Supervisor,
    classify,
)

CMD_ERROR = "JOB_ENTRYPOINT_COMMAND_ERROR"


@pytest.mark.parametrize(
    ("end", "kind", "resubmit", "code"),
    [
        (JobEnd("SUCCEEDED", driver_exit_code=0), EndKind.SUCCEEDED, False, 0),
        (JobEnd("STOPPED"), EndKind.STOPPED, False, 1),
        (JobEnd(None), EndKind.LOST_WITH_HEAD, True, EXIT_INFRASTRUCTURE),
        # SIGKILLed driver: Python's -9, or a shell's 137; whatever its last record says
        (JobEnd("FAILED", CMD_ERROR, -9, record_state="training"), EndKind.DRIVER_LOST, True, 3),
        (JobEnd("FAILED", CMD_ERROR, 137), EndKind.DRIVER_LOST, True, 3),
        (JobEnd("FAILED", "JOB_SUPERVISOR_ACTOR_DIED"), EndKind.DRIVER_LOST, True, 3),
        (JobEnd("FAILED", "JOB_ENTRYPOINT_COMMAND_START_ERROR"), EndKind.DRIVER_LOST, True, 3),
        # the run's own verdicts
        (JobEnd("FAILED", CMD_ERROR, 2), EndKind.BAD_INPUT, False, 2),
        (
            JobEnd("FAILED", CMD_ERROR, 1, record_state="failed", record_failure="workers"),
            EndKind.USER_CODE,
            False,
            1,
        ),
        (
            JobEnd("FAILED", CMD_ERROR, 1, record_state="failed", record_failure="non_finite"),
            EndKind.NON_FINITE,
            False,
            1,
        ),
        (
            JobEnd("FAILED", CMD_ERROR, 1, record_state="failed", record_failure="bad_input"),
            EndKind.BAD_INPUT,
            False,
            2,
        ),
        (
            JobEnd("FAILED", CMD_ERROR, 1, record_state="failed", record_failure="spike_limit"),
            EndKind.SPIKE_LIMIT,
            False,
            1,
        ),
        # the workers only died (processes, nodes, preemptions) past the spec's limits
        (
            JobEnd("FAILED", CMD_ERROR, 1, record_state="failed", record_failure="infrastructure"),
            EndKind.WORKERS_LOST,
            True,
            3,
        ),
        (JobEnd("FAILED", CMD_ERROR, 1), EndKind.RUN_FAILED, False, 1),  # no record: still its own
        (JobEnd("FAILED", "RUNTIME_ENV_SETUP_FAILURE"), EndKind.SETUP_FAILED, False, 1),
        # an older Ray: no exit code, no error type; the record decides
        (JobEnd("FAILED", record_state="training"), EndKind.DRIVER_LOST, True, 3),
        (
            JobEnd("FAILED", record_state="failed", record_failure="workers"),
            EndKind.USER_CODE,
            False,
            1,
        ),
        # a record saying the driver failed by itself outweighs Ray's supervisor dying after
        (
            JobEnd(
                "FAILED",
                "JOB_SUPERVISOR_ACTOR_DIED",
                record_state="failed",
                record_failure="workers",
            ),
            EndKind.USER_CODE,
            False,
            1,
        ),
    ],
)
def test_classify_resubmits_only_what_the_cluster_lost(
    end: JobEnd, kind: EndKind, resubmit: bool, code: int
) -> None:
    verdict = classify(end)
    assert (verdict.kind, verdict.resubmit, verdict.exit_code) == (kind, resubmit, code)


def test_a_user_code_verdict_says_so_with_the_drivers_error() -> None:
    end = JobEnd(
        "FAILED",
        CMD_ERROR,
        1,
        record_state="failed",
        record_failure="workers",
        record_error="training failed on rank 0: ValueError: boom",
    )
    assert classify(end).reason.startswith("user code")
    assert "ValueError: boom" in classify(end).reason


def test_the_driver_records_the_kind_of_its_failure() -> None:
    assert failure_kind(TrainingFailed("training failed on rank 0: ValueError: boom")) == "workers"
    nan = TrainingFailed("training failed on rank 1: NonFiniteLossError: loss is nan")
    assert failure_kind(nan) == "non_finite"
    wrapped = TrainingFailed("x")
    wrapped.__cause__ = NonFiniteLossError("nan")
    assert failure_kind(wrapped) == "non_finite"
    died = "training failed on rank 1: ActorDiedError: The actor died unexpectedly"
    assert failure_kind(TrainingFailed(died)) == "infrastructure"
    # as Ray Train 2.60 reports a dead worker: its health check failed with Ray's error
    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    from raytrain.driver.results import worker_errors

    class GroupError(Exception):
        worker_failures = {0: WorkerHealthCheckFailedError("worker 0 failed", ActorDiedError())}

    assert failure_kind(TrainingFailed(worker_errors(GroupError()))) == "infrastructure"
    preempted = "training failed on rank 0: PreemptedError: preempted: SIGTERM received"
    assert failure_kind(TrainingFailed([died, preempted])) == "infrastructure"
    # one rank's own exception makes it the user's code, whatever else died with it
    assert failure_kind(TrainingFailed([died, "training failed on rank 0: KeyError: 'x'"])) == (
        "workers"
    )
    spent = "training failed on rank 0: LossSpikeLimitError: the loss spiked again"
    assert failure_kind(TrainingFailed(spent)) == "spike_limit"
    assert failure_kind(SpecError("model: no such class")) == "bad_input"
    assert failure_kind(KeyboardInterrupt()) == "interrupted"
    assert failure_kind(RuntimeError("ray said no")) == "driver"


def test_the_policy_backs_off_doubling_to_a_cap_within_its_budget() -> None:
    policy = ResubmitPolicy(max_resubmits=2, backoff_s=1, max_backoff_s=5)
    assert [policy.delay(n) for n in range(1, 6)] == [1, 2, 4, 5, 5]
    assert policy.allows(0) and policy.allows(1) and not policy.allows(2)
    assert not ResubmitPolicy(max_resubmits=0).allows(0)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [({"max_resubmits": -1}, "--max-resubmits -1"), ({"head_wait_s": 0}, "--head-wait 0")],
)
def test_a_bad_budget_is_bad_input_naming_its_flag(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(SupervisionError, match=flag) as caught:
        ResubmitPolicy(**kwargs)
    assert caught.value.exit_code == 2


def test_the_cli_refuses_a_negative_budget_without_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        [
            "submit",
            "spec.yaml",
            "--address",
            "http://127.0.0.1:1",
            "--supervise",
            "--max-resubmits",
            "-1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--max-resubmits -1: must be 0 or more" in err
    assert "Traceback" not in err


# -- the loop, driven by fakes -------------------------------------------------------------


@dataclass
class FakeJob:
    """A job whose ``info()`` answers from a script: each item a JobDetails-like object or
    an exception to raise."""

    job_id: str
    answers: list[Any]
    submitted: list[str] = field(default_factory=list)

    def info(self) -> Any:
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def progress(self) -> None:
        return None


def details(status: str, code: int | None = None, error_type: str | None = None) -> Any:
    return SimpleNamespace(
        status=SimpleNamespace(value=status),
        driver_exit_code=code,
        error_type=error_type,
        message="",
        start_time=None,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def __call__(self) -> float:
        return self.now


def _supervisor(submissions: list[Any], policy: ResubmitPolicy, clock: Clock, said: list[str]):
    def submit(again: bool) -> Any:
        assert again
        item = submissions.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    return Supervisor(submit, policy, poll_s=1, sleep=clock.sleep, clock=clock, say=said.append)


def test_a_job_lost_with_its_head_is_resubmitted_once_the_head_answers() -> None:
    down = ServerUnreachable("http://h:8265: the job server stopped answering")
    first = FakeJob("a", [details("RUNNING"), down, down, JobUnknown("job a: no such job")])
    second = FakeJob("b", [details("RUNNING"), details("SUCCEEDED", 0)])
    clock, said = Clock(), []
    sup = _supervisor([down, second], ResubmitPolicy(backoff_s=1), clock, said)
    story = sup.run(first)  # type: ignore[arg-type]
    assert story.job_ids == ["a", "b"] and story.resubmits == 1
    resubmitted = [line for line in said if line.startswith("resubmitted")]
    assert resubmitted == [
        "resubmitted job a as b (1 of 3): the head does not know the job: "
        "it was restarted without it"
    ]


def test_a_failure_in_user_code_is_not_resubmitted() -> None:
    job = FakeJob("a", [details("FAILED", 1, CMD_ERROR)])
    clock, said = Clock(), []
    with pytest.raises(SupervisionError, match="not resubmitted") as caught:
        _supervisor([], ResubmitPolicy(), clock, said).run(job)  # type: ignore[arg-type]
    assert caught.value.exit_code == 1 and caught.value.result.job_ids == ["a"]


def test_the_budget_and_the_head_wait_are_bounded() -> None:
    killed = details("FAILED", -9, CMD_ERROR)
    jobs = [FakeJob(name, [killed]) for name in "abc"]
    clock, said = Clock(), []
    sup = _supervisor(jobs[1:], ResubmitPolicy(max_resubmits=2), clock, said)
    with pytest.raises(SupervisionError, match="budget of 2") as caught:
        sup.run(jobs[0])  # type: ignore[arg-type]
    assert caught.value.exit_code == EXIT_INFRASTRUCTURE
    assert caught.value.result.job_ids == ["a", "b", "c"]

    down = ServerUnreachable("down")
    clock = Clock()
    sup = _supervisor([], ResubmitPolicy(head_wait_s=60, max_backoff_s=8), clock, said)
    with pytest.raises(SupervisionError, match="did not answer for 60s") as caught:
        sup.run(FakeJob("a", [down]))  # type: ignore[arg-type]
    assert caught.value.exit_code == EXIT_INFRASTRUCTURE and clock.now == 60
    assert max(clock.slept) <= 8


def test_a_refused_token_or_an_unknown_error_is_raised_not_waited_out() -> None:
    for error in (TokenRefused("refused"), JobsError("info on h: something else")):
        with pytest.raises(JobsError):
            _supervisor([], ResubmitPolicy(), Clock(), []).run(
                FakeJob("a", [error])  # type: ignore[arg-type]
            )
