"""Lightning's ``ModelParallelStrategy`` under Ray Train, with raytrain's clipping and an
optional pipeline: the class ``_compat.lightning.model_parallel_strategy_class``
subclasses with its parts. Imported only from there (it imports Lightning and Ray)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import ray.train
import ray.train.torch
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import _PATH
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim import Optimizer

# what Lightning's model-parallel save writes beside the shards (``_METADATA_FILENAME``)
META_FILE = "meta.pt"

# the pipeline mesh's dimensions, outermost first: a pipeline's stages may cross nodes
# (one activation per micro-batch goes between them), a tensor-parallel group should not
MESH_DIMS = ("pipeline", "data_parallel", "tensor_parallel")


class PipelineParts(Protocol):
    """What the model-parallel strategy needs from ``raytrain.pipeline`` (passed in, so
    nothing here imports raytrain above ``errors``): the stage count, and ``build``,
    which cuts the module to this rank's stage on the mesh and returns its runner."""

    @property
    def stages(self) -> int: ...

    def build(self, module: pl.LightningModule, mesh: DeviceMesh) -> PipelineStages: ...


class PipelineStages(Protocol):
    """What the strategy calls on this rank's pipeline runner (``raytrain.pipeline.runner.
    PipelineRunner``), once ``PipelineParts.build`` has made it."""

    def shard(self) -> None: ...

    def clip_options(self) -> dict[str, Any]: ...

    def apply_grads(self, scale: float = ...) -> None: ...

    def sync_shared_grads(self) -> None: ...

    def step(self, batch: Any, batch_idx: int, training: bool) -> torch.Tensor: ...


def batch_and_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
    """A step's batch and batch index, however Lightning passed them."""
    batch = args[0] if args else kwargs["batch"]
    index = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    return batch, int(index)


def broadcast_state(module: Any, device: torch.device) -> None:
    """Give every rank rank 0's weights and buffers, before ``configure_model`` shards them.

    DDP does this when it wraps a model. Under model parallelism nothing does: torch's
    ``distribute_tensor`` scatters a tensor-parallel layer's shards from rank 0, but the
    parts the plan leaves replicated (embeddings, norms) and FSDP2's shards each come from
    the rank's own initialisation, which differs without ``trainer.seed``. A tensor-parallel
    group then sums partial results of different weights. Tensors on the meta device (a
    deferred initialisation) have nothing to send yet."""
    import torch
    import torch.distributed as dist

    for tensor in module.state_dict().values():
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            sent = tensor.to(device)  # NCCL sends from the GPU
            dist.broadcast(sent, src=0)
            if sent is not tensor:
                tensor.copy_(sent)


def flat_optimizer_state(module: Any, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer``'s state for a sharded checkpoint, flattened: every entry keyed by its
    parameter's path (``param_groups.<path>.lr``), not by its group's index. Lightning
    saves the nested form, whose ``param_groups.0.params`` lists the parameters a rank
    holds: under a pipeline the stages hold different ones, DCP keeps one rank's copy of
    that key, and the other stages' groups then load empty (``KeyError: 'betas'``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)
    return get_optimizer_state_dict(module, optimizer, options=options)


def load_sharded(path: Path, module: Any, optimizers: list[Optimizer], strict: bool) -> None:
    """Load a sharded (DCP) checkpoint's model and optimizer states into ``module`` and
    ``optimizers``, as Lightning's model-parallel load does, reading each optimizer's state
    in the form it was saved in: flattened (``flat_optimizer_state``) or Lightning's
    nested one (checkpoints written before raytrain flattened them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model_state = {"state_dict": get_model_state_dict(module)}
    dcp.load(model_state, checkpoint_id=path)
    module.load_state_dict(model_state["state_dict"], strict=strict)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        nested = f"{key}.param_groups.0.params" in saved
        options = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=not nested)
        state = {key: get_optimizer_state_dict(module, optimizer, options=options)}
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state[key], options=options)


class RaytrainModelParallelStrategy(ModelParallelStrategy):
    """See ``_compat.lightning.model_parallel_strategy_class``, which subclasses it with
    its parts set."""

    clip_norm: Callable[..., Any]
    clip_value: Callable[..., Any]
    pipeline: PipelineParts | None = None
    _stages: PipelineStages | None = None  # the pipeline's runner on this rank, once set up

    @property
    def pipeline_runner(self) -> PipelineStages | None:
        """This rank's ``raytrain.pipeline.runner.PipelineRunner``; None without a
        pipeline."""
        return self._stages

    @property
    def root_device(self) -> torch.device:
        return ray.train.torch.get_device()

    @property
    def num_processes(self) -> int:  # processes on this node
        return int(ray.train.get_context().get_local_world_size())

    def setup_environment(self) -> None:
        if self.pipeline is None:
            super().setup_environment()
            broadcast_state(self.lightning_module, self.root_device)
            return
        from torch.distributed.device_mesh import init_device_mesh

        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        module: Any = self.lightning_module
        sizes: Any = (self._data_parallel_size, self._tensor_parallel_size)  # not auto
        shape = (self.pipeline.stages, *sizes)
        self._device_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=MESH_DIMS)
        module._device_mesh = self._device_mesh
        broadcast_state(module, self.root_device)
        self._stages = self.pipeline.build(module, self._device_mesh)
        if not is_overridden("configure_model", module):
            module.configure_model = self._stages.shard

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        return flat_optimizer_state(self.model, getattr(optimizer, "_optimizer", optimizer))

    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not (path / ".metadata").is_file():  # not a DCP folder: Lightning's own load
            return super().load_checkpoint(checkpoint_path, weights_only)
        module: Any = self.lightning_module
        load_sharded(path, self.model, self.optimizers, module.strict_loading)
        return torch.load(path / META_FILE, weights_only=weights_only)

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        plugin: Any = self.precision_plugin
        stage = {} if self._stages is None else self._stages.clip_options()

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
            self.clip_norm(plugin.main_params(optimizer), clip_val, **stage)

        def clip_grad_by_value(optimizer: Optimizer, clip_val: float) -> None:
            self.clip_value(plugin.main_params(optimizer), clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm
        plugin.clip_grad_by_value = clip_grad_by_value

    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._stages is None:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            return self._stages.step(*batch_and_index(args, kwargs), training=True)

    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._stages is None:
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self._stages.step(*batch_and_index(args, kwargs), training=False)

    def backward(
        self,
        closure_loss: torch.Tensor,
        optimizer: Optimizer | None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        if self._stages is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # the schedule ran forward and backward in training_step; its gradients, held
        # past Lightning's zero_grad, are added now, between the hooks around a
        # backward (Lightning's callbacks and raytrain's step clock read them)
        self.pre_backward(closure_loss)
        module: Any = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        trainer: Any = module.trainer
        self._stages.apply_grads(1.0 / trainer.accumulate_grad_batches)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kw: Any,
    ) -> Any:
        if self._stages is None:
            return super().optimizer_step(optimizer, closure, model, **kw)
        stages = self._stages

        def closure_then_sync() -> Any:
            result = closure()
            stages.sync_shared_grads()  # before clipping, which Lightning does next
            return result

        return super().optimizer_step(optimizer, closure_then_sync, model, **kw)
