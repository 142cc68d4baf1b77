"""The strategy's checks the schema cannot see, on the spec alone: the driver runs them
before Ray starts (``driver.preflight``, ``driver.launcher``), and nothing here imports
Lightning, torch or ``worker/``. With ``worker.strategy``, which builds the strategy in
each worker, it is one of the two modules that branch on ``strategy.name``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrain.spec.sections import FsdpSpec, ModelParallelSpec

if TYPE_CHECKING:
    from raytrain.spec.sections import JobSpec


# Precisions Lightning's ModelParallelStrategy refuses (it accepts 32-true, bf16-mixed,
# bf16-true and 16-true; "32" and "bf16" are the first two's other names).
UNSUPPORTED_MP_PRECISION = ("16-mixed", "16", "64-true", "64")


def strategy_problems(spec: JobSpec) -> list[str]:
    """Problems of ``spec.strategy`` the schema cannot see: a strategy's options only come
    with it (they would silently do nothing), hybrid sharding needs GPUs, a model-parallel
    mesh must hold every worker. The driver checks them before Ray starts; nothing here
    imports Lightning."""
    for option, default in (("fsdp", FsdpSpec()), ("model_parallel", ModelParallelSpec())):
        if spec.strategy.name != option and getattr(spec.strategy, option) != default:
            return [
                f"strategy.{option}: options for the {option} strategy, but strategy.name "
                f"is {spec.strategy.name!r}"
            ]
    if (
        spec.strategy.name == "fsdp"
        and spec.strategy.fsdp.sharding == "hybrid"
        and spec.scaling.use_gpu is False
    ):
        # Lightning builds the hybrid (nodes x workers) device mesh on CUDA devices
        return [
            "strategy.fsdp.sharding: hybrid needs GPU workers (scaling.use_gpu: true, or "
            "auto on a cluster with GPUs); on CPU workers use full"
        ]
    if spec.strategy.name == "model_parallel":
        return mesh_problems(spec)
    return []


def mesh_problems(spec: JobSpec) -> list[str]:
    """A model-parallel mesh must hold exactly the workers, at any size the run may take.

    An elastic range is refused: Ray Train restarts at any count in it, most of which a
    fixed tensor-parallel size does not divide, and a checkpoint written on one mesh is
    read on another only where torch's DCP reshards it (``docs/decisions/060-*``)."""
    mp, scaling = spec.strategy.model_parallel, spec.scaling
    if scaling.elastic:
        return [
            "scaling.num_workers: an elastic [min, max] range cannot run strategy "
            "model_parallel, whose mesh (strategy.model_parallel.data_parallel_size x "
            "tensor_parallel_size) must hold every worker; give a fixed count"
        ]
    if spec.trainer.precision in UNSUPPORTED_MP_PRECISION:
        return [
            f"trainer.precision: {spec.trainer.precision} is not supported by strategy "
            "model_parallel (Lightning's ModelParallelStrategy): use bf16-mixed, "
            "bf16-true, 16-true or 32-true"
        ]
    world, tp, dp = scaling.max_workers, mp.tensor_parallel_size, mp.data_parallel_size
    if dp == "auto":
        if world % tp:
            return [
                f"strategy.model_parallel.tensor_parallel_size: {tp} does not divide "
                f"scaling.num_workers ({world}): data_parallel_size auto is their "
                "quotient"
            ]
        return []
    if dp * tp != world:
        return [
            f"strategy.model_parallel: data_parallel_size x tensor_parallel_size is "
            f"{dp} x {tp} = {dp * tp}, but scaling.num_workers is {world}: the mesh must "
            "hold every worker (data_parallel_size: auto takes the quotient)"
        ]
    return []
