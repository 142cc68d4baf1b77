"""The trained model, logged to the run's MLflow record at the end of a run.

What logging it imports (``mlflow.pytorch`` alone takes seconds: it imports Lightning, and
the model's own module) is started in the background once training runs (``preload``),
so the end of the run does not wait for it. A failure to log does not undo the training:
it is a warning and a tag, unless ``register_as`` asked for the model, which then ends the
command with ``ModelNotRegistered`` (exit 1) once the run is closed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from raytrain.driver.background import Background
from raytrain.spec import JobSpec
from raytrain.util.redaction import redact


class ModelLog:
    """The model of one run; ``tracker`` returns the run's open ``MlflowTracker``."""

    def __init__(self, job: JobSpec, tracker: Callable[[], Any]):
        self.job = job
        self._tracker = tracker
        self._preload: Background | None = None
        # (checkpoint, why) when register_as was asked for and the model was not logged
        self.missing: tuple[str, str] | None = None

    def preload(self) -> None:
        """Start the imports logging needs, once, when the spec logs the model."""
        if self._preload is None and self.job.tracking.mlflow.log_model:
            self._preload = Background(self._import_for_model)

    def _import_for_model(self) -> None:
        import mlflow.pytorch  # noqa: F401

        from raytrain.util.imports import import_object

        import_object(self.job.model.class_path)

    def log(self, checkpoint: str | None) -> str | None:
        """Log the model with ``checkpoint``'s weights to the run (and the registry, with
        ``tracking.mlflow.register_as``); returns its URI. A failure is printed and tagged
        (``raytrain.model_error``), and None returned; with ``register_as`` it is also kept
        for ``raise_if_unregistered``."""
        mlflow_spec = self.job.tracking.mlflow
        if not mlflow_spec.log_model or not checkpoint:
            return None
        tracker = self._tracker()
        try:
            if self._preload is not None:
                self._preload.result()
            from raytrain.checkpoints.export import trained_model
            from raytrain.tracking.model_logging import log_model

            uri = log_model(
                tracker,
                trained_model(self.job, checkpoint),
                register_as=mlflow_spec.register_as,
                job=self.job,
            )
        except Exception as exc:
            message = redact(f"{type(exc).__name__}: {exc}")
            print(
                f"raytrain: warning: the model was not logged to MLflow: {message}", file=sys.stderr
            )
            tracker.set_tags({"raytrain.model_error": message[:5000]})
            if mlflow_spec.register_as:
                self.missing = (checkpoint, message)
            return None
        tracker.set_tags({"raytrain.model_uri": uri})  # its weights: raytrain.best_checkpoint
        return uri

    def raise_if_unregistered(self, run_id: str | None) -> None:
        """``ModelNotRegistered`` (exit 1) when ``register_as`` was asked for and the model
        was not logged: the run ``run_id`` is FINISHED in MLflow (training did finish), but
        whatever deploys ``models:/NAME`` must not find an older version and carry on."""
        if self.missing is None:
            return
        from raytrain.errors import ModelNotRegistered

        checkpoint, message = self.missing
        raise ModelNotRegistered(
            f"tracking.mlflow.register_as: the model was not registered as "
            f"{self.job.tracking.mlflow.register_as!r}: {message}. Training finished (MLflow "
            f"run {run_id}, tag raytrain.model_error); its checkpoint is "
            f"kept: {checkpoint} (raytrain export writes its weights)"
        )
