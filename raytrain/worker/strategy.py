"""Strategy names to Lightning strategy objects that run under Ray Train.

With ``spec.strategy_checks`` (the spec's checks), the one place that branches on
``strategy.name``. Ray's strategies take their device and
process group from the Ray Train worker; ``RayLightningEnvironment`` tells Lightning each
worker's rank and world size.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from raytrain._compat.lightning import fsdp_strategy_class, model_parallel_strategy_class
from raytrain.spec import DdpSpec, JobSpec

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import Strategy
    from ray.train import TrainContext

# strategy.fsdp.sharding → torch's ShardingStrategy names
SHARDING = {
    "full": "FULL_SHARD",
    "grad_op": "SHARD_GRAD_OP",
    "no_shard": "NO_SHARD",
    "hybrid": "HYBRID_SHARD",
}


def prepare(spec: JobSpec, trainer: pl.Trainer) -> pl.Trainer:
    """``trainer``, checked by Ray's ``prepare_trainer`` where Ray has a class for the
    strategy. It only checks the strategy is one of Ray's; Ray has none for Lightning's
    ``ModelParallelStrategy``, which ``_compat.lightning`` adapts as Ray's adapt theirs."""
    from ray.train.lightning import prepare_trainer

    return trainer if spec.strategy.name == "model_parallel" else prepare_trainer(trainer)


def data_rank(spec: JobSpec, rank: int, world_size: int) -> tuple[int, int]:
    """(rank, world size) the data is sharded by: the data-parallel replica ``rank`` is
    in, and the replicas.

    Ranks of one tensor-parallel group split each layer of one model replica, and the
    stages of one pipeline each run part of it, so they all read the same rows. The mesh
    is (pipeline, data_parallel, tensor_parallel) in row-major order, so rank r sits at
    data-parallel coordinate (r // tp) mod dp; with one stage, r // tp."""
    pp, tp = spec.strategy.pipeline_parallel_size, spec.strategy.tensor_parallel_size
    replicas = world_size // (tp * pp)
    return (rank // tp) % replicas, replicas


def rank_zero_holds_state(spec: JobSpec) -> bool:
    """Whether rank 0 alone holds the whole training state and can dump it without the
    other ranks (DDP): ``checkpoint.memory_every_n_steps`` then has rank 0 keep it alone.
    Under FSDP and model parallelism each rank holds a shard (a state dict is a
    collective): every rank takes part in each keep."""
    return spec.strategy.name == "ddp"


def shards_checkpoints(spec: JobSpec) -> bool:
    """Whether every rank writes its own shard of a checkpoint (sharded FSDP, or the
    model-parallel strategy's DTensors)."""
    if spec.strategy.name == "model_parallel":
        return True
    return spec.strategy.name == "fsdp" and spec.strategy.fsdp.state_dict == "sharded"


def compression(spec: JobSpec) -> DdpSpec | None:
    """The gradient compression the run asks for (``strategy.ddp``; None: none, or a
    strategy other than DDP, under which the spec's checks refuse one)."""
    ddp = spec.strategy.ddp
    return ddp if spec.strategy.name == "ddp" and ddp.comm_hook != "none" else None


# PowerSGD on gloo: every gradient in one DDP bucket (see _powersgd_buckets)
ONE_BUCKET_MB = 1 << 20


def _powersgd_buckets(spec: JobSpec) -> dict[str, Any]:
    """DDP's bucket size under PowerSGD on CPU workers (gloo): one bucket. PowerSGD
    all-reduces a bucket's second factor from a callback of the first's future; with two
    buckets in flight on gloo, that collective and the next bucket's first one were
    issued in different orders on the two ranks (an 8.4M-parameter MLP in two buckets
    under ``bench/comm_hooks.py``: 1 run of 6 aborted, "Received data size doesn't match
    expected size"; in one bucket none of 9).
    NCCL keeps them apart on streams; on GPUs DDP's buckets stay as they are."""
    if spec.strategy.ddp.comm_hook != "powersgd":
        return {}
    import ray.train.torch

    return {} if ray.train.torch.get_device().type == "cuda" else {"bucket_cap_mb": ONE_BUCKET_MB}


def build_strategy(spec: JobSpec, model: torch.nn.Module | None = None) -> Strategy:
    """The Lightning strategy for ``spec.strategy``; FSDP resolves its module class names
    against ``model``."""
    from ray.train.lightning import RayDDPStrategy

    if spec.strategy.name == "ddp":
        # Every parameter gets a gradient in the models we expect; not searching for unused
        # ones saves a graph traversal per step. Bucket views avoid a gradient copy.
        buckets = _powersgd_buckets(spec)
        return RayDDPStrategy(find_unused_parameters=False, gradient_as_bucket_view=True, **buckets)
    if spec.strategy.name == "model_parallel":
        import ray.train

        context = ray.train.get_context()
        dp, tp = spec.strategy.model_parallel.sizes(context.get_world_size())
        _warn_if_tensor_group_spans_nodes(context, tp)
        from raytrain.pipeline import Pipeline
        from raytrain.worker import grad_clip

        mp = spec.strategy.model_parallel
        pipeline = Pipeline.of(mp) if mp.pipeline_parallel_size > 1 else None
        strategy = model_parallel_strategy_class(
            grad_clip.clip_grad_norm_, grad_clip.clip_grad_value_, pipeline
        )
        return strategy(
            data_parallel_size=dp, tensor_parallel_size=tp, save_distributed_checkpoint=True
        )
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


def tensor_group_spans_nodes(world_rank: int, local_rank: int, tp: int) -> bool:
    """Whether this rank's node begins inside a tensor-parallel group, which then spans
    more than one node.

    Ray Train numbers ranks node by node (a node's ranks are consecutive, the first of
    local rank 0), and Lightning's (data_parallel, tensor_parallel) mesh puts ranks
    g*tp .. g*tp + tp - 1 in group g. A group spans nodes exactly where a node's first rank
    is not a multiple of tp, so each node's first worker can tell, with no collective."""
    return local_rank == 0 and world_rank % tp != 0


def _warn_if_tensor_group_spans_nodes(context: TrainContext, tp: int) -> None:
    """Say so on the first worker of a node that begins inside a tensor-parallel group: the
    run works, but the group's collectives go over the network."""
    rank = context.get_world_rank()
    if not tensor_group_spans_nodes(rank, context.get_local_rank(), tp):
        return
    first = rank - rank % tp
    print(
        f"raytrain: warning: the tensor-parallel group of ranks {first}-{first + tp - 1} "
        f"spans more than one node (rank {rank} begins a node): its collectives, several "
        "per layer, go over the network. Choose a "
        "strategy.model_parallel.tensor_parallel_size that divides the workers of every "
        f"node ({context.get_local_world_size()} on this one).",
        file=sys.stderr,
        flush=True,
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
            [
                f"{field}: no submodule of class {n!r} in the model (it has: {', '.join(have)})"
                for n in missing
            ]
        )
    return [present[n] for n in names]


def build_plugins(spec: JobSpec) -> list[Any]:
    """Lightning plugins every strategy needs under Ray Train."""
    from ray.train.lightning import RayLightningEnvironment

    return [RayLightningEnvironment()]
