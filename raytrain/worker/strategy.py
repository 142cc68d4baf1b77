"""Strategy names to Lightning strategy objects that run under Ray Train.

The one place that branches on ``strategy.name``. Ray's strategies take their device and
process group from the Ray Train worker; ``RayLightningEnvironment`` tells Lightning each
worker's rank and world size.
"""

from __future__ import annotations

from typing import Any

from raytrain._compat.lightning import fsdp_strategy_class
from raytrain.spec import JobSpec

# strategy.fsdp.sharding → torch's ShardingStrategy names
SHARDING = {
    "full": "FULL_SHARD",
    "grad_op": "SHARD_GRAD_OP",
    "no_shard": "NO_SHARD",
    "hybrid": "HYBRID_SHARD",
}


def strategy_problems(spec: JobSpec) -> list[str]:
    """Problems of ``spec.strategy`` the schema cannot see: FSDP options only come with the
    FSDP strategy (they would silently do nothing), hybrid sharding needs GPUs. The driver
    checks them before Ray starts; nothing here imports Lightning."""
    from raytrain.spec import FsdpSpec

    if spec.strategy.name != "fsdp" and spec.strategy.fsdp != FsdpSpec():
        return [f"strategy.fsdp: options for the fsdp strategy, but strategy.name is "
                f"{spec.strategy.name!r}"]  # fmt: skip
    if spec.strategy.fsdp.sharding == "hybrid" and spec.scaling.use_gpu is False:
        # Lightning builds the hybrid (nodes x workers) device mesh on CUDA devices
        return ["strategy.fsdp.sharding: hybrid needs GPU workers (scaling.use_gpu: true, or "
                "auto on a cluster with GPUs); on CPU workers use full"]  # fmt: skip
    return []


def shards_checkpoints(spec: JobSpec) -> bool:
    """Whether every rank writes its own shard of a checkpoint (sharded FSDP)."""
    return spec.strategy.name == "fsdp" and spec.strategy.fsdp.state_dict == "sharded"


def build_strategy(spec: JobSpec, model: Any = None) -> Any:
    """The Lightning strategy for ``spec.strategy``; FSDP resolves its module class names
    against ``model``."""
    from ray.train.lightning import RayDDPStrategy

    if spec.strategy.name == "ddp":
        # Every parameter gets a gradient in the models we expect; not searching for unused
        # ones saves a graph traversal per step. Bucket views avoid a gradient copy.
        return RayDDPStrategy(find_unused_parameters=False, gradient_as_bucket_view=True)
    fsdp = spec.strategy.fsdp
    wrap = module_classes(model, fsdp.auto_wrap, "strategy.fsdp.auto_wrap")
    recompute = module_classes(
        model, fsdp.activation_checkpointing, "strategy.fsdp.activation_checkpointing"
    )
    kwargs: dict[str, Any] = {}
    if fsdp.sharding == "hybrid":
        # shard within a node, replicate across nodes: a (nodes, workers per node) mesh
        kwargs["device_mesh"] = _hybrid_mesh()
    return fsdp_strategy_class()(
        sharding_strategy=SHARDING[fsdp.sharding],
        auto_wrap_policy=set(wrap) or None,
        activation_checkpointing_policy=set(recompute) or None,
        cpu_offload=fsdp.cpu_offload,
        state_dict_type=fsdp.state_dict,
        use_orig_params=True,
        **kwargs,
    )


def _hybrid_mesh() -> tuple[int, int]:
    import ray.train

    context = ray.train.get_context()
    per_node = context.get_local_world_size()
    return (context.get_world_size() // per_node, per_node)


def module_classes(model: Any, names: list[str], field: str) -> list[type]:
    """The classes of ``model``'s submodules named in ``names`` (``Class`` or
    ``package.module:Class``); a name no submodule has is an error naming ``field``."""
    if not names:
        return []
    from raytrain.errors import SpecError

    present: dict[str, type] = {}
    for module in model.modules():
        cls = type(module)
        present[cls.__name__] = cls
        present[f"{cls.__module__}:{cls.__qualname__}"] = cls
    missing = [n for n in names if n not in present]
    if missing:
        have = sorted({c.__name__ for c in present.values()})
        raise SpecError(
            [f"{field}: no submodule of class {n!r} in the model (it has: {', '.join(have)})"
             for n in missing]
        )  # fmt: skip
    return [present[n] for n in names]


def build_plugins(spec: JobSpec) -> list[Any]:
    """Lightning plugins every strategy needs under Ray Train."""
    from ray.train.lightning import RayLightningEnvironment

    return [RayLightningEnvironment()]
