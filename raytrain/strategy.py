"""Strategy names to Lightning strategy objects that run under Ray Train.

The one place that branches on ``strategy.name``. Ray's strategies take their device and
process group from the Ray Train worker; ``RayLightningEnvironment`` tells Lightning each
worker's rank and world size.
"""

from __future__ import annotations

from typing import Any

from raytrain.spec import JobSpec


def build_strategy(spec: JobSpec) -> Any:
    """The Lightning strategy for ``spec.strategy``."""
    from ray.train.lightning import RayDDPStrategy

    if spec.strategy.name == "ddp":
        # Every parameter gets a gradient in the models we expect; not searching for unused
        # ones saves a graph traversal per step. Bucket views avoid a gradient copy.
        return RayDDPStrategy(find_unused_parameters=False, gradient_as_bucket_view=True)
    raise ValueError(f"strategy.name: {spec.strategy.name!r} is not supported yet")


def build_plugins(spec: JobSpec) -> list[Any]:
    """Lightning plugins every strategy needs under Ray Train."""
    from ray.train.lightning import RayLightningEnvironment

    return [RayLightningEnvironment()]
