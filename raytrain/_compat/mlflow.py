"""MLflow internals raytrain relies on, written for MLflow 3 (``versions.SUPPORTED``).

- ``last_steps``: ``RunData._metric_objs``, the ``Metric`` objects behind
  ``run.data.metrics`` (each metric's latest value, with its step). Without it, the step of
  every metric would cost one ``get_metric_history`` call each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import MlflowClient


def last_steps(client: MlflowClient, run_id: str) -> dict[str, int]:
    """The last step logged for each metric of the run: MLflow's latest value per key is
    the one at the highest step."""
    data = client.get_run(run_id).data
    return {metric.key: metric.step for metric in data._metric_objs}
