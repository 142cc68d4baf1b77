"""The driver's failure policy (``driver.failure_policy``) without Ray running: a non-finite
loss is never retried, preemptions are counted apart from failures, and each limit holds.
The policy is asked as Ray Train's controller asks it, through ``_compat.ray_train``'s
adapter in front of Ray's own default policy (which counts ``max_failures``).

The inputs are what Ray Train's controller gives a policy: a ``WorkerGroupError`` (Ray's own
public class) whose ``worker_failures`` map each rank to the exception it raised, as Ray
Train's poll unwraps it; a wrapped error is a plain class with the ``cause`` Ray's task errors
carry.
"""

from __future__ import annotations

import pytest
from ray.train import FailureConfig
from ray.train.v2.api.exceptions import WorkerGroupError

from raytrain._compat.ray_train_controller import PolicyAdapter
from raytrain.driver.failure_policy import Decision, FailurePolicy
from raytrain.errors import NonFiniteLossError, PreemptedError

RETRY, RAISE = "RETRY", "RAISE"


class Wrapped(Exception):
    """An error that carries a worker's exception as ``cause`` (as ``RayTaskError`` does)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"wrapped: {cause}")
        self.cause = cause


def group_error(*errors: BaseException) -> WorkerGroupError:
    """Ray Train's error for a worker group whose ranks 0.. raised ``errors``."""
    return WorkerGroupError("worker errors", dict(enumerate(errors)))


def decide(policy: PolicyAdapter, *errors: BaseException) -> str:
    return policy.make_decision(group_error(*errors)).value


def policy(max_failures: int = 0, max_preemptions: int = -1) -> PolicyAdapter:
    config = FailureConfig(max_failures=max_failures, max_preemption_failures=max_preemptions)
    return PolicyAdapter(config, FailurePolicy(max_preemptions))


def _nan() -> NonFiniteLossError:
    return NonFiniteLossError("the loss became NaN at optimizer step 7")


def _chained_nan() -> RuntimeError:
    try:
        try:
            raise _nan()
        except NonFiniteLossError as exc:
            raise RuntimeError("the train loop failed") from exc
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(
    "errors",
    [
        (_nan(), _nan()),  # every rank, as FiniteGuard raises it
        (_nan(), RuntimeError("collective aborted")),  # one rank's NaN, the other collateral
        (Wrapped(_nan()),),  # carried as a task error's cause
        (_chained_nan(),),  # raised from it
        (_nan(), PreemptedError("preempted")),  # a NaN wins over a preemption
    ],
    ids=["all-ranks", "one-rank", "cause", "__cause__", "with-preemption"],
)
def test_a_non_finite_loss_is_never_retried(errors: tuple[BaseException, ...]) -> None:
    unlimited = policy(max_failures=-1, max_preemptions=-1)
    assert decide(unlimited, *errors) == RAISE


def test_data_that_cannot_be_trained_on_is_never_retried() -> None:
    from raytrain.errors import BadDataError

    bad = BadDataError("data: the image cat/7.png (of s3://b/train) does not decode")
    assert decide(policy(max_failures=-1), Wrapped(bad), RuntimeError("aborted")) == RAISE


def test_an_ordinary_failure_is_retried_up_to_max_failures() -> None:
    p = policy(max_failures=2)
    crash = RuntimeError("worker died")
    assert [decide(p, crash) for _ in range(3)] == [RETRY, RETRY, RAISE]


def test_max_failures_zero_raises_at_the_first_failure() -> None:
    assert decide(policy(max_failures=0), RuntimeError("worker died")) == RAISE


def test_preemptions_are_counted_apart_from_failures() -> None:
    p = policy(max_failures=1, max_preemptions=2)
    preempted = (PreemptedError("SIGTERM"), PreemptedError("SIGTERM"))
    # two preemptions are retried, and leave max_failures untouched ...
    assert decide(p, *preempted) == RETRY
    assert decide(p, *preempted) == RETRY
    assert decide(p, RuntimeError("worker died")) == RETRY
    # ... the next failure is over max_failures, and the next preemption over its own limit
    assert decide(p, RuntimeError("worker died")) == RAISE
    assert decide(p, *preempted) == RAISE


def test_a_preemption_wrapped_by_ray_is_still_a_preemption() -> None:
    p = policy(max_failures=0, max_preemptions=1)
    assert decide(p, Wrapped(PreemptedError("SIGTERM"))) == RETRY
    assert decide(p, Wrapped(PreemptedError("SIGTERM"))) == RAISE


def test_unlimited_preemptions_are_always_retried() -> None:
    p = policy(max_failures=0, max_preemptions=-1)
    assert all(decide(p, PreemptedError("SIGTERM")) == RETRY for _ in range(50))


def test_a_preemption_the_driver_asked_for_stops_the_run() -> None:
    # SIGUSR1 to the driver (a Slurm job's end): the ranks stop at their committed
    # checkpoint and the run ends there, however many preemptions are allowed; a failure
    # of another kind meanwhile is still Ray's to count
    asked = [False]
    config = FailureConfig(max_failures=1, max_preemption_failures=-1)
    p = PolicyAdapter(config, FailurePolicy(-1, requested=lambda: asked[0]))
    preempted = (PreemptedError("SIGTERM"), PreemptedError("SIGTERM"))
    assert decide(p, *preempted) == RETRY
    asked[0] = True
    assert decide(p, RuntimeError("worker died")) == RETRY
    assert decide(p, *preempted) == RAISE


def test_a_preemption_on_some_ranks_only_is_a_failure() -> None:
    # a rank that failed for its own reason is not explained by another rank's notice
    p = policy(max_failures=0, max_preemptions=-1)
    assert decide(p, PreemptedError("SIGTERM"), RuntimeError("out of memory")) == RAISE


def test_a_cause_chain_that_loops_does_not_hang_the_driver() -> None:
    error = Wrapped(RuntimeError("worker died"))
    error.cause = error  # a chain that comes back to itself
    p = policy(max_failures=1)
    assert decide(p, error) == RETRY  # an ordinary failure, decided


def test_the_policy_alone_defers_ordinary_failures_to_ray() -> None:
    # the pure policy: no Ray objects in, a Decision out
    alone = FailurePolicy(max_preemptions=0)
    assert alone.decide([RuntimeError("worker died")]) is Decision.DEFER
    assert alone.decide([]) is Decision.DEFER  # a lost node: no worker's exception
    assert alone.decide([_nan()]) is Decision.RAISE
    assert alone.decide([PreemptedError("SIGTERM")]) is Decision.RAISE  # over its limit of 0


def test_a_loss_spike_is_rolled_back_without_counting_and_a_spent_budget_stops() -> None:
    from raytrain.errors import LossSpikeError, LossSpikeLimitError

    p = policy(max_failures=0)
    spike = (LossSpikeError("loss spike"), RuntimeError("collective aborted"))
    # retried however many times (the ranks count rollbacks), and max_failures stays whole
    assert [decide(p, *spike) for _ in range(3)] == [RETRY, RETRY, RETRY]
    assert decide(p, Wrapped(LossSpikeLimitError("spent")), LossSpikeError("x")) == RAISE
    assert decide(policy(max_failures=-1), LossSpikeLimitError("spent")) == RAISE
    assert decide(p, RuntimeError("worker died")) == RAISE  # max_failures 0 untouched


def test_injected_faults_are_retried_without_counting_against_max_failures() -> None:
    """``failure.chaos``: each injected kill is claimed by one failure, retried and not
    counted; a failure with no kill to claim counts as ever (and a NaN is never retried)."""
    kills = [True, True]

    def injected() -> bool:
        return kills.pop() if kills else False

    config = FailureConfig(max_failures=0, max_preemption_failures=-1)
    p = PolicyAdapter(config, FailurePolicy(-1, injected=injected))
    died = RuntimeError("worker died")
    assert [decide(p, died), decide(p, died), decide(p, died)] == [RETRY, RETRY, RAISE]
    kills.append(True)
    assert decide(p, _nan()) == RAISE
    assert kills == [True]  # a NaN is decided before any kill is claimed
