"""``raytrain doctor``'s reading of a run: the typical step from the ranks' timelines, and
what bounds it, with the numbers."""

from __future__ import annotations

from raytrain.records.run_status import Restart, RunStatus
from raytrain.tracking.doctor import describe, diagnose, step_parts


def _status(**fields) -> RunStatus:
    base = {
        "name": "r",
        "state": "finished",
        "started_at": 0.0,
        "updated_at": 100.0,
        "driver": "h:1",
    }
    return RunStatus.model_validate({**base, **fields})


def _step(**parts: float) -> dict[str, float]:
    step = {
        "data_wait": 1.0,
        "forward": 3.0,
        "backward": 4.0,
        "comm_wait": 1.0,
        "optimizer": 1.0,
        "hooks": 0.5,
        **parts,
    }
    return {**{k: v / 1000 for k, v in step.items()}, "step": sum(step.values()) / 1000}


def test_the_average_step_is_each_ranks_mean_window_averaged_over_ranks() -> None:
    histories = {
        "timeline/rank0/forward_mean_s": [(5, 1.0), (10, 5.0), (15, 3.0)],
        "timeline/rank1/forward_mean_s": [(5, 4.0), (10, 4.0)],
        "timeline/rank0/forward_p90_s": [(5, 99.0)],  # quantiles are not where time went
        "train_loss": [(5, 0.5)],
    }
    assert step_parts(histories) == {"forward": 3.5}
    assert step_parts({"train_loss": [(5, 0.5)]}) == {}


def test_what_bounds_the_step_first_match_wins() -> None:
    kinds = {
        "data-bound": _step(data_wait=8.0),
        "communication-bound": _step(comm_wait=8.0),
        "checkpoint-bound": _step(hooks=4.0),
        "compute-bound": _step(),
    }
    for kind, parts in kinds.items():
        (found,) = diagnose(parts, None, {})
        assert found.kind == kind, (kind, found)
    (data,) = diagnose(_step(data_wait=8.0), None, {})
    assert data.text == "data-bound: each step waited 8.0 ms for its batch, 46% of a 17.5 ms step"
    (compute,) = diagnose(_step(), None, {})
    assert compute.text.startswith("compute-bound: forward 3.0 ms, backward 4.0 ms")


def test_a_straggler_explains_the_wait_and_startup_and_restarts_are_counted() -> None:
    tags = {"raytrain.straggler": "rank 1 on n1: 4.0x the other ranks' median busy time"}
    status = _status(
        first_report_at=40.0,
        restarts=[
            Restart(at=50.0, step=20, reason="RuntimeError: boom", lost_steps=7),
            Restart(at=70.0, step=60, reason="PreemptedError: preempted", lost_steps=3),
        ],
    )
    kinds = [f.kind for f in diagnose(_step(comm_wait=8.0), status, tags)]
    assert kinds == ["compute-bound", "straggler", "startup-heavy", "restarts"]
    lines = describe(diagnose(_step(), status, {}), "r")
    assert (
        "  startup-heavy: 40.0 s of the attempt's 100.0 s passed before the first report "
        "(40%)" in lines
    )
    assert any(
        line.startswith("  2 restart(s) made the run train at least 10 step(s) again")
        for line in lines
    )
    assert diagnose({}, _status(first_report_at=10.0), {}) == []  # short startup, no timeline
    assert describe([], "r") == ["r: no step timeline or status record to read yet"]
