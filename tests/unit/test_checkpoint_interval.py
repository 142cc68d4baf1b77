"""``checkpoint.every_n_steps: auto``'s rule (Young/Daly) and the schedule it retunes."""

from __future__ import annotations

import math

import pytest

from raytrain.checkpoints.interval import (
    ASSUMED_MTBF_S,
    MOST_AUTO_STEPS,
    AutoInterval,
    young_daly_steps,
)
from raytrain.worker.schedule import CheckpointSchedule


def test_young_daly_grows_with_the_save_cost_and_shrinks_with_the_failure_rate() -> None:
    # sqrt(2 x 0.5 s x 3600 s) = 60 s of training; at 0.1 s a step, 600 steps
    assert young_daly_steps(0.5, 3600, 0.1) == 600
    slower_saves = young_daly_steps(2.0, 3600, 0.1)
    more_failures = young_daly_steps(0.5, 900, 0.1)
    assert slower_saves == 1200 > 600 > more_failures == 300
    assert young_daly_steps(0.5, 3600, 0.2) == 300  # slower steps: fewer of them
    # bounds: at least one step, at most MOST_AUTO_STEPS, whatever the figures
    assert young_daly_steps(0.0, 3600, 0.1) == 1
    assert young_daly_steps(1e-9, 1e-9, 10.0) == 1
    assert young_daly_steps(10.0, 1e12, 1e-6) == MOST_AUTO_STEPS
    assert young_daly_steps(1.0, 1.0, 0.0) == MOST_AUTO_STEPS
    assert young_daly_steps(1.0, 1.0, math.nan) == MOST_AUTO_STEPS


def test_the_mtbf_comes_measured_else_from_the_spec_else_assumed() -> None:
    auto = AutoInterval(mtbf_s=600.0)
    assert auto.choose(None) is None  # nothing measured yet
    auto.saved(0.2)
    auto.trained(10, 1.0)
    measured = auto.choose(30.0)
    assert measured is not None and (measured.mtbf_s, measured.mtbf_from) == (30.0, "measured")
    assert measured.steps == young_daly_steps(0.2, 30.0, 0.1)
    spec = auto.choose(None)
    assert spec is not None and (spec.mtbf_s, spec.mtbf_from) == (600.0, "failure.mtbf_s")
    assumed = AutoInterval(None)
    assumed.saved(0.2)
    assumed.trained(10, 1.0)
    choice = assumed.choose(None)
    assert choice is not None and (choice.mtbf_s, choice.mtbf_from) == (ASSUMED_MTBF_S, "assumed")
    assert "sqrt(2 x save x MTBF)" in choice.describe()


def test_a_chaos_run_starts_from_its_injected_mtbf_and_failure_mtbf_s_wins() -> None:
    """A `--chaos 15` run with `every_n_steps: auto` chose from a day's MTBF (every 3,000
    steps) though its user had said a fault would come every 15 s."""
    from raytrain.spec import FailureSpec

    chaos = FailureSpec.model_validate({"chaos": {"mtbf_s": 15}})
    assert chaos.expected_mtbf() == (15.0, "failure.chaos.mtbf_s")
    both = FailureSpec.model_validate({"chaos": {"mtbf_s": 15}, "mtbf_s": 600})
    assert both.expected_mtbf() == (600.0, "failure.mtbf_s")
    assert FailureSpec().expected_mtbf() == (None, "assumed")
    auto = AutoInterval(*chaos.expected_mtbf())
    auto.saved(0.2)
    auto.trained(10, 1.0)
    choice = auto.choose(None)
    assert choice is not None and (choice.mtbf_s, choice.mtbf_from) == (
        15.0,
        "failure.chaos.mtbf_s",
    )


def test_the_figures_are_means_of_the_last_samples() -> None:
    auto = AutoInterval(None, window=2)
    for blocked in (9.0, 1.0, 3.0):
        auto.saved(blocked)
    auto.trained(0, 5.0)  # no step: no sample
    auto.trained(4, 2.0)
    choice = auto.choose(100.0)
    assert choice is not None and choice.save_s == pytest.approx(2.0)
    assert choice.step_s == pytest.approx(0.5)


def test_a_retuned_schedule_counts_from_its_anchor() -> None:
    schedule = CheckpointSchedule(every_n_steps=10, every_n_epochs=None)
    assert [s for s in range(1, 31) if schedule.at_step(s)] == [10, 20, 30]
    schedule.retune(10, 7)
    assert [s for s in range(1, 31) if schedule.at_step(s)] == [17, 24]
    assert not schedule.at_step(10)  # the anchor itself was the last checkpoint
    assert not CheckpointSchedule(None, 1).at_step(5)
