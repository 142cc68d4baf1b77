"""Lightning's ``ModelParallelStrategy`` under Ray Train, with raytrain's clipping and an
optional pipeline: the class ``_compat.lightning.model_parallel_strategy_class``
subclasses with its parts. Imported only from there (it imports Lightning and Ray)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import ray.train
import ray.train.torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden

# the pipeline mesh's dimensions, outermost first: a pipeline's stages may cross nodes
# (one activation per micro-batch goes between them), a tensor-parallel group should not
MESH_DIMS = ("pipeline", "data_parallel", "tensor_parallel")


class PipelineParts(Protocol):
    """What the model-parallel strategy needs from ``raytrain.pipeline`` (passed in, so
    nothing here imports raytrain above ``errors``): the stage count, and ``build``,
    which cuts the module to this rank's stage on the mesh and returns its runner."""

    @property
    def stages(self) -> int: ...

    def build(self, module: Any, mesh: Any) -> Any: ...


def batch_and_index(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
    """A step's batch and batch index, however Lightning passed them."""
    batch = args[0] if args else kwargs["batch"]
    index = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    return batch, int(index)


def broadcast_state(module: Any, device: Any) -> None:
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


class RaytrainModelParallelStrategy(ModelParallelStrategy):
    """See ``_compat.lightning.model_parallel_strategy_class``, which subclasses it with
    its parts set."""

    clip_norm: Callable[..., Any]
    clip_value: Callable[..., Any]
    pipeline: PipelineParts | None = None
    _stages: Any = None  # the pipeline's runner on this rank, once set up

    @property
    def root_device(self) -> Any:
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

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        plugin: Any = self.precision_plugin
        stage = {} if self._stages is None else self._stages.clip_options()

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            self.clip_norm(plugin.main_params(optimizer), clip_val, **stage)

        def clip_grad_by_value(optimizer: Any, clip_val: float) -> None:
            self.clip_value(plugin.main_params(optimizer), clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm
        plugin.clip_grad_by_value = clip_grad_by_value

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._stages is None:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            return self._stages.step(*batch_and_index(args, kwargs), training=True)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._stages is None:
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self._stages.step(*batch_and_index(args, kwargs), training=False)

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if self._stages is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # the schedule ran forward and backward in training_step; its gradients, held
        # past Lightning's zero_grad, are added now, between the hooks around a
        # backward (Lightning's callbacks and raytrain's step clock read them)
        self.pre_backward(closure_loss)
        module: Any = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._stages.apply_grads()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kw: Any) -> Any:
        if self._stages is None:
            return super().optimizer_step(optimizer, closure, model, **kw)
        stages = self._stages

        def closure_then_sync() -> Any:
            result = closure()
            stages.sync_shared_grads()  # before clipping, which Lightning does next
            return result

        return super().optimizer_step(optimizer, closure_then_sync, model, **kw)
