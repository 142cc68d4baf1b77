"""raytrain: train PyTorch Lightning modules on Ray, from a job spec.

The public surface: load and validate a spec, train it, and the errors it may raise.
"""

from raytrain.errors import (
    RaytrainError,
    RunStateError,
    SpecError,
    StorageError,
    TrackingError,
    TrainingFailed,
)
from raytrain.spec import JobSpec, load_spec

__all__ = [
    "FitResult",
    "JobSpec",
    "RaytrainError",
    "RunStateError",
    "SpecError",
    "StorageError",
    "TrackingError",
    "TrainingFailed",
    "fit",
    "load_spec",
    "validate",
]


def __getattr__(name: str):
    # The launcher pulls in Ray and Lightning; load it only when it is used.
    if name in ("fit", "validate", "FitResult"):
        from raytrain import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'raytrain' has no attribute {name!r}")
