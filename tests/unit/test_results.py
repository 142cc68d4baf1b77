"""What a finished run hands its user: ``final_metrics`` keeps the user's metrics only."""

from __future__ import annotations

from raytrain.checkpoints import layout
from raytrain.contract import HANG_KEY
from raytrain.driver.results import final_metrics
from raytrain.records.rollback_record import ROLLBACK_KEY
from raytrain.spec import JobSpec


def test_no_key_raytrain_adds_to_reports_reaches_the_final_metrics() -> None:
    """Every ``*_KEY`` raytrain reports for itself (a chaos run's last report carried
    ``_failure``, which the summary printed), whatever new one is added to ``layout``."""
    own = [v for k, v in vars(layout).items() if k.endswith("_KEY") and isinstance(v, str)]
    own += [layout.MONITOR_MISSING, HANG_KEY, ROLLBACK_KEY, "kind"]
    assert {layout.FAILURE_KEY, layout.CHECKPOINT_KEY, layout.SCORE_KEY} <= set(own)
    latest = {key: "x" for key in own} | {"val_acc": 0.97, "step": 230, "system/cpu": 1.0}
    job = JobSpec.model_validate(
        {"name": "r", "model": {"class_path": "m:M"}, "data": {"train": {"uri": "d"}}}
    )
    assert final_metrics(None, latest, job) == {"val_acc": 0.97, "step": 230, "system/cpu": 1.0}
