"""The strategy's checks the schema cannot see, on the spec alone: the driver runs them
before Ray starts (``driver.preflight``, ``driver.launcher``), and nothing here imports
Lightning, torch or ``worker/``. With ``worker.strategy``, which builds the strategy in
each worker, it is one of the two modules that branch on ``strategy.name``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrain.spec.sections import (
    DdpSpec,
    FsdpSpec,
    ModelParallelSpec,
    PipelineSpec,
    PowerSgdSpec,
)

if TYPE_CHECKING:
    from raytrain.spec.sections import JobSpec


# Precisions Lightning's ModelParallelStrategy refuses (it accepts 32-true, bf16-mixed,
# bf16-true and 16-true; "32" and "bf16" are the first two's other names).
UNSUPPORTED_MP_PRECISION = ("16-mixed", "16", "64-true", "64")


def strategy_problems(spec: JobSpec) -> list[str]:
    """Problems of ``spec.strategy`` the schema cannot see: a strategy's options only come
    with it (they would silently do nothing), hybrid sharding and SyncBatchNorm need GPUs,
    a model-parallel mesh must hold every worker. The driver checks them before Ray starts;
    nothing here imports Lightning."""
    options = (("ddp", DdpSpec()), ("fsdp", FsdpSpec()), ("model_parallel", ModelParallelSpec()))
    for option, default in options:
        if spec.strategy.name != option and getattr(spec.strategy, option) != default:
            return [
                f"strategy.{option}: options for the {option} strategy, but strategy.name "
                f"is {spec.strategy.name!r}"
            ]
    ddp = spec.strategy.ddp
    if ddp.comm_hook != "powersgd" and ddp.powersgd != PowerSgdSpec():
        return [
            "strategy.ddp.powersgd: options for comm_hook powersgd, but comm_hook is "
            f"{ddp.comm_hook!r}"
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
    if spec.trainer.passthrough.get("sync_batchnorm") and spec.scaling.use_gpu is False:
        # torch's SyncBatchNorm refuses CPU tensors: DDP's constructor fails in every worker
        return [
            "trainer.sync_batchnorm: torch's SyncBatchNorm runs on GPU workers only "
            "(scaling.use_gpu: true, or auto on a cluster with GPUs); on CPU workers leave "
            "it out"
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
            "tensor_parallel_size x pipeline_parallel_size) must hold every worker; give a "
            "fixed count"
        ]
    if spec.trainer.precision in UNSUPPORTED_MP_PRECISION:
        return [
            f"trainer.precision: {spec.trainer.precision} is not supported by strategy "
            "model_parallel (Lightning's ModelParallelStrategy): use bf16-mixed, "
            "bf16-true, 16-true or 32-true"
        ]
    world, dp = scaling.max_workers, mp.data_parallel_size
    tp, pp = mp.tensor_parallel_size, mp.pipeline_parallel_size
    problems = pipeline_problems(mp, pp)
    if dp == "auto":
        if pp == 1 and world % tp:
            return [
                f"strategy.model_parallel.tensor_parallel_size: {tp} does not divide "
                f"scaling.num_workers ({world}): data_parallel_size auto is their "
                "quotient"
            ]
        if world % (tp * pp):
            return [
                *problems,
                f"strategy.model_parallel: tensor_parallel_size x pipeline_parallel_size is "
                f"{tp} x {pp} = {tp * pp}, which does not divide scaling.num_workers "
                f"({world}): data_parallel_size auto is their quotient",
            ]
        return problems
    if dp * tp * pp != world:
        return [
            *problems,
            "strategy.model_parallel: data_parallel_size x tensor_parallel_size x "
            f"pipeline_parallel_size is {dp} x {tp} x {pp} = {dp * tp * pp}, but "
            f"scaling.num_workers is {world}: the mesh must hold every worker "
            "(data_parallel_size: auto takes the quotient)",
        ]
    return problems


def pipeline_problems(mp: ModelParallelSpec, pp: int) -> list[str]:
    """A pipeline's options need a pipeline, its micro-batches fill every stage, and its
    split points cut it into exactly ``pp`` stages (whether the model has them is
    ``pipeline.split``'s check, on the model)."""
    where = "strategy.model_parallel.pipeline"
    if pp == 1:
        if mp.pipeline != PipelineSpec():
            return [f"{where}: options for a pipeline, but pipeline_parallel_size is 1"]
        return []
    problems = []
    micro = mp.pipeline.microbatch_count(pp)
    if micro < pp:
        problems.append(
            f"{where}.microbatches: {micro} is fewer than the {pp} stages "
            "(pipeline_parallel_size): a stage would wait with nothing to do at every step"
        )
    points = mp.pipeline.split_points
    if points and len(points) != pp - 1:
        problems.append(
            f"{where}.split_points: {len(points)} given, but {pp} stages begin at "
            f"{pp - 1} points (the first stage begins at the model's start)"
        )
    if len(set(points)) != len(points):
        problems.append(f"{where}.split_points: {points} names a point twice")
    return problems
