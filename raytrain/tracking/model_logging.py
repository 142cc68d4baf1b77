"""A trained model into its MLflow run (and the registry): ``log_model``, in MLflow's ``pt2``
format where the model's forward traces, else ``pickle``; the model's own package travels
with it as code."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from raytrain.spec import JobSpec
from raytrain.tracking.mlflow_tracker import MlflowTracker, package_versions

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from mlflow.models.model import ModelInfo


def log_model(
    tracker: MlflowTracker,
    model: torch.nn.Module,
    *,
    register_as: str | None = None,
    job: JobSpec | None = None,
) -> str:
    """Log ``model`` (a torch module, on CPU) with ``mlflow.pytorch`` under ``model``,
    registered as ``register_as`` when given; returns the model's URI. Every model is
    logged: in MLflow's ``pt2`` format (a traced graph) with a signature and input
    example when one is found (``model_example.input_example``: the model's
    ``example_input_array``, else the first rows of ``job``'s data), else, or when
    tracing fails, in the ``pickle`` format, which needs none; the tags
    ``raytrain.model_format`` and ``raytrain.model_input_example`` say which and why.
    The model's own package (its class's top-level package, raytrain's for the bundled
    models) travels with it as code, so loading needs only the pinned pip requirements,
    which come from this environment rather than MLflow's inference (a subprocess that
    imports the model: slow, and it may guess wrong)."""
    import mlflow
    import mlflow.pytorch

    from raytrain.tracking.model_example import input_example

    example, source = input_example(model, job)
    installed = package_versions(("torch", "lightning", "torchmetrics")).items()
    requirements = [f"{package}=={found}" for package, found in installed if found]
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracker.tracking_uri)

    def log(**kwargs: Any) -> ModelInfo:
        with mlflow.start_run(run_id=tracker.run_id, nested=mlflow.active_run() is not None):
            return mlflow.pytorch.log_model(
                model,
                name="model",
                registered_model_name=register_as,
                pip_requirements=requirements,
                code_paths=[_package_of(type(model))],
                **kwargs,
            )

    try:
        info, fmt = _log_pt2(log, model, example)
        if info is None:
            info = log(serialization_format="pickle")
    finally:
        mlflow.set_tracking_uri(previous)
    tracker.set_tags(
        {"raytrain.model_format": fmt[:5000], "raytrain.model_input_example": source[:5000]}
    )
    return info.model_uri


def _log_pt2(
    log: Callable[..., ModelInfo], model: torch.nn.Module, example: Any
) -> tuple[ModelInfo | None, str]:
    """Log ``model`` through ``log`` in MLflow's ``pt2`` format with a signature from
    ``example``: (its model info, "pt2"), or (None, why it must be pickle instead)."""
    if example is None:
        return None, "pickle (no input example to trace forward with)"
    import torch
    from mlflow.models import infer_signature

    # torch.export cannot trace every forward, and a declared example need not fit forward,
    # nor convert to numpy (bfloat16): each falls back to pickle
    try:
        with torch.no_grad():
            output = model(example)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"forward returns a {type(output).__name__}, not a tensor")
        array = example.detach().cpu().numpy()
        signature = infer_signature(array, output.detach().cpu().numpy())
        return log(serialization_format="pt2", input_example=array, signature=signature), "pt2"
    except Exception as exc:
        return None, f"pickle (pt2 failed: {type(exc).__name__}: {str(exc)[:300]})"


def _package_of(cls: type) -> str:
    """The folder of ``cls``'s top-level package, or its module's file if it has none."""
    import sys

    top = sys.modules[cls.__module__.split(".")[0]]
    path = top.__file__ or ""
    return os.path.dirname(path) if path.endswith("__init__.py") else path
