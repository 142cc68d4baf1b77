"""raytrain: train PyTorch Lightning modules on Ray, from a job spec.

The public surface: load and validate a spec, train it here (``fit``) or on a cluster
(``submit``, a ``JobHandle`` to follow it; ``supervise`` submits, follows and resubmits a
job lost with its head or driver, ``SupervisionError`` otherwise), a run's live progress
from anywhere (``status``, a ``RunStatus``), one embedded Ray for several runs
(``start_local``), a set of many small files packed into Parquet shards (``pack``, a
``PackSummary``), and the errors it may raise.
"""

from typing import Any

from raytrain.errors import (
    RaytrainError,
    RunStateError,
    SpecError,
    StorageError,
    TrackingError,
    TrainingFailed,
)
from raytrain.records.run_status import RunStatus
from raytrain.records.run_status import status_of as status
from raytrain.spec import JobSpec, load_spec
from raytrain.submit.client import JobHandle, JobsError, attach, list_jobs, submit
from raytrain.submit.supervisor import SupervisionError, supervise

__all__ = [
    "FitResult",
    "JobHandle",
    "JobSpec",
    "JobsError",
    "PackSummary",
    "RaytrainError",
    "RunStateError",
    "RunStatus",
    "SpecError",
    "StorageError",
    "SupervisionError",
    "SweepResult",
    "TrackingError",
    "TrainingFailed",
    "attach",
    "fit",
    "list_jobs",
    "load_spec",
    "pack",
    "start_local",
    "status",
    "submit",
    "supervise",
    "tune",
    "validate",
]


def __getattr__(name: str) -> Any:
    # The launcher pulls in Ray and Lightning; load it only when it is used.
    if name in ("fit", "validate", "FitResult"):
        from raytrain.driver import launcher

        return getattr(launcher, name)
    if name in ("tune", "SweepResult"):  # sweeps on Ray Tune
        from raytrain.sweep import results, runner

        return runner.tune if name == "tune" else results.SweepResult
    if name == "start_local":  # one embedded Ray for several fits (a pipeline's)
        from raytrain.driver.ray_runtime import start_local

        return start_local
    if name in ("pack", "PackSummary"):  # raytrain pack (pyarrow, Pillow: no Ray)
        from raytrain.data import pack

        return pack.pack if name == "pack" else pack.PackSummary
    raise AttributeError(f"module 'raytrain' has no attribute {name!r}")
