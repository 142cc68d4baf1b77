"""Strategy names to Lightning strategy objects that run under Ray Train.

The one place that branches on ``strategy.name``. Ray's strategies take their device and
process group from the Ray Train worker; ``RayLightningEnvironment`` tells Lightning each
worker's rank and world size.
"""

from __future__ import annotations

from typing import Any

from raytrain.spec import JobSpec

# strategy.fsdp.sharding → torch's ShardingStrategy names
SHARDING = {
    "full": "FULL_SHARD",
    "grad_op": "SHARD_GRAD_OP",
    "no_shard": "NO_SHARD",
    "hybrid": "HYBRID_SHARD",
}


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
    return _fsdp_strategy_class()(
        sharding_strategy=SHARDING[fsdp.sharding],
        auto_wrap_policy=set(wrap) or None,
        activation_checkpointing_policy=set(recompute) or None,
        cpu_offload=fsdp.cpu_offload,
        state_dict_type=fsdp.state_dict,
        use_orig_params=True,
        **kwargs,
    )


def _fsdp_strategy_class() -> type:
    """Ray's FSDP strategy, able to run on CPU workers (gloo) too.

    Lightning hands FSDP ``device_id=root_device.index``, which is None for the CPU, and
    torch's FSDP then looks for an accelerator and refuses a CPU-only machine; given the
    CPU device itself it shards on the CPU. Lightning's FSDP precision plugin also refuses
    to clip gradients by norm, for want of the root FSDP module (``torch.nn.utils``'s
    clipping would see only this rank's shards); the strategy has it and clips with it.
    """
    import torch
    from lightning.pytorch.strategies.fsdp import (
        _move_torchmetrics_to_device,
        _setup_activation_checkpointing,
    )
    from ray.train.lightning import RayFSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel

    class RaytrainFSDPStrategy(RayFSDPStrategy):
        def _setup_model(self, model: Any) -> Any:
            root = self._wrap(model)

            def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
                root.clip_grad_norm_(clip_val)  # a collective: every rank clips

            self.precision_plugin.clip_grad_by_norm = clip_grad_by_norm
            return root

        def _wrap(self, model: Any) -> Any:
            wrapped = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
            if self.root_device.type != "cpu" or wrapped:
                return super()._setup_model(model)
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
            _move_torchmetrics_to_device(model, self.root_device)
            _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
            return model

    return RaytrainFSDPStrategy


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
