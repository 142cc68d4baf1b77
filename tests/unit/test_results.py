"""What a finished run hands its user: ``final_metrics`` keeps the user's metrics only."""

from __future__ import annotations

from raytrain.contract import SCORE_KEY
from raytrain.driver.results import final_metrics
from raytrain.spec import JobSpec
from tests.unit.events import report


def test_nothing_raytrain_adds_to_reports_reaches_the_final_metrics() -> None:
    """A report as Ray keeps it with a checkpoint (``Report.for_ray``: the score Ray ranks
    by, the report's kind) loses what raytrain adds for itself; what it says of itself
    beside its numbers (a checkpoint, a stop, a startup) is in typed fields, not keys."""
    done = report(230, val_acc=0.97, score=0.97, checkpoint=True, started=0, stopped="x")
    kept = done.for_ray() | {"system/cpu": 1.0}
    assert SCORE_KEY in kept and kept["kind"] == "step"
    job = JobSpec.model_validate(
        {"name": "r", "model": {"class_path": "m:M"}, "data": {"train": {"uri": "d"}}}
    )
    assert final_metrics(None, kept, job) == {
        "val_acc": 0.97,
        "step": 230,
        "epoch": 0,
        "world_size": 2,
        "system/cpu": 1.0,
    }
