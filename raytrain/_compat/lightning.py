"""Lightning internals raytrain relies on, written for Lightning 2.6 (``versions.SUPPORTED``).

- ``skip_sigterm_broadcast``: the fit loop's ``epoch_loop._broadcast_sigterm_tensor``, the
  collective Lightning runs before every training batch under DDP.
- ``set_epoch_length``: ``fit_loop._combined_loader.limits``, ``fit_loop.max_batches``,
  ``fit_loop._data_fetcher.length`` and ``trainer.val_check_batch``: an epoch's length
  after the loader was restored.
- ``validation_may_follow``: ``fit_loop.epoch_loop.batch_progress`` (``is_last_batch``,
  ``current.ready``) and ``trainer.val_check_batch``: a validation may run after the batch
  just run (at the epoch's end, or every ``val_check_interval`` batches).
- ``epoch_last_batch``: ``fit_loop.epoch_loop.batch_progress.is_last_batch``: the batch
  just run was its epoch's last (the epoch's end has not run yet).
- ``accumulate_from``: ``fit_loop.epoch_loop._accumulated_batches_reached`` and its
  ``batch_progress.current.ready``: where an accumulation of gradients starts;
  ``restored_mid_epoch``: the same progress (``current.ready``, ``is_last_batch``) read
  as where a restore stands in its epoch.
- ``checkpoint_loader_states`` and ``checkpoint_at_epoch_end``: a Lightning checkpoint's
  ``loops.fit_loop.state_dict.combined_loader`` (the train loaders' saved states, which the
  fit loop loads into them before it first iterates them) and
  ``loops.fit_loop["epoch_loop.batch_progress"].is_last_batch``.
- ``epoch_cut_short``, ``epoch_in_progress`` and ``uncount_cut_epoch``:
  ``fit_loop.epoch_progress`` (``current`` and ``total``),
  ``fit_loop.epoch_loop._num_ready_batches_reached`` and a checkpoint's
  ``loops.fit_loop.epoch_progress`` and ``epoch``: an epoch that ``max_steps`` ended early.
- ``fsdp_strategy_class``: Ray's ``RayFSDPStrategy`` with ``_setup_model`` overridden
  (CPU sharding, clipping by the root module), using
  ``lightning.pytorch.strategies.fsdp._move_torchmetrics_to_device`` and
  ``_setup_activation_checkpointing``, the strategy's ``_activation_checkpointing_kwargs``
  and its precision plugin's ``clip_grad_by_norm``.

- ``model_parallel_strategy_class``: Lightning's ``ModelParallelStrategy`` with
  ``root_device`` and ``num_processes`` taken from Ray Train (Lightning's read
  ``parallel_devices``, one CPU under Ray), and its precision plugin's
  ``clip_grad_by_norm``/``clip_grad_by_value`` replaced; under a pipeline, its
  ``_device_mesh`` (and the module's) built three-dimensional and its
  ``_setup_distributed``, ``_data_parallel_size`` and ``_tensor_parallel_size`` used to
  build it, the grandparent's ``setup_environment`` called past Lightning's 2-D mesh.

``tests/unit/test_compat.py`` pins each on a real Trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.nn import Module
    from torch.optim import Optimizer

    from raytrain._compat.model_parallel import PipelineParts


def skip_sigterm_broadcast(trainer: Any) -> None:
    """Drop the collective Lightning runs before every batch to agree on a SIGTERM.

    Under DDP, Lightning broadcasts rank 0's "received SIGTERM" flag before every training
    batch: a collective (and a sync point) per step. Its flag is never set here: Lightning
    installs its handler only from the main thread, and Ray Train runs the train loop in
    another. SIGTERM is a preemption notice that ``raytrain.worker.preemption`` records and
    ``worker.guards.PreemptionGuard`` agrees on, about once a second of training.
    """
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        raise AttributeError("Lightning's training epoch loop has no _broadcast_sigterm_tensor")
    loop._broadcast_sigterm_tensor = lambda: None


def validation_may_follow(trainer: pl.Trainer) -> bool:
    """Whether a validation may run after the training batch just run: its epoch's last, or
    one ``val_check_interval`` falls on. Lightning builds the validation's loader and
    fetches its first batch before ``on_validation_start``. Errs towards yes (it does not
    ask ``check_val_every_n_epoch``)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    if progress.is_last_batch:
        return True
    every = trainer.val_check_batch
    return isinstance(every, int) and every > 0 and progress.current.ready % every == 0


def epoch_last_batch(trainer: pl.Trainer) -> bool:
    """Whether the training batch just run was its epoch's last: in its
    ``on_train_batch_end`` the epoch's end (validation, epoch-end hooks, the epoch count)
    has not run yet."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def set_epoch_length(trainer: pl.Trainer, length: int) -> None:
    """Make ``length`` the current epoch's number of batches, as if Lightning had read it at
    setup: its loop's limit, the fetcher of an epoch already iterating, and the validation
    interval when it is a fraction of the epoch. No change when it already is."""
    fit_loop = trainer.fit_loop
    combined = fit_loop._combined_loader
    if combined is None or length == fit_loop.max_batches:
        return
    combined.limits = [length]
    fit_loop.max_batches = length
    fetcher = fit_loop._data_fetcher
    if fetcher is not None and fetcher.length is not None:  # already iterating this epoch
        fetcher.length = length
    if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch != float("inf"):
        trainer.val_check_batch = max(1, int(length * trainer.val_check_interval))


def restored_mid_epoch(trainer: pl.Trainer) -> int:
    """The batches of the epoch a restore stands at when it is mid-epoch (Lightning then
    resumes that epoch without ``on_train_epoch_start``); 0 at an epoch's start or end."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    mid_epoch = progress.current.ready > 0 and not progress.is_last_batch
    return int(progress.current.ready) if mid_epoch else 0


def accumulate_from(trainer: Any, offset: Callable[[], int]) -> None:
    """Make Lightning count accumulated batches from ``offset()`` batches into the epoch.

    Lightning steps the optimizer after batch ``ready`` (its count of the epoch's batches)
    when ``ready % accumulate_grad_batches == 0``, or at the epoch's last batch. That counts
    from the epoch's start, so a run restored mid-epoch with another accumulation (an
    elastic restart that keeps its global batch) would step after a part of one: restored
    at batch 15 with an accumulation of 2, its first step would take 1 batch. With
    ``offset()`` 15 it takes batches 16 and 17.
    """
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_accumulated_batches_reached"):
        raise AttributeError("Lightning's training epoch loop has no _accumulated_batches_reached")

    def reached() -> bool:
        ready = loop.batch_progress.current.ready - offset()
        return bool(ready % trainer.accumulate_grad_batches == 0)

    loop._accumulated_batches_reached = reached


def dump_state(trainer: pl.Trainer) -> dict[str, Any]:
    """The full Lightning state, as ``trainer.save_checkpoint`` would write it (weights,
    optimizers, schedulers, loops and the loaders' positions, callbacks), without writing
    it or waiting on the other ranks: its tensors are the live ones."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def checkpoint_loader_states(checkpoint: dict[str, Any]) -> list[dict[str, Any]]:
    """The train loaders' states a Lightning checkpoint holds, as the list the fit loop will
    load into them (changing its items changes what they resume from); empty when none
    keeps a position."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
    states: list[dict[str, Any]] = fit_loop.get("state_dict", {}).get("combined_loader", [])
    return states


def checkpoint_at_epoch_end(checkpoint: dict[str, Any]) -> bool:
    """Whether a Lightning checkpoint was taken after its epoch's last batch."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    return bool(progress and progress.get("is_last_batch"))


def epoch_cut_short(trainer: Any) -> bool:
    """Whether the fit loop has counted an epoch whose batches did not all run.

    When ``max_steps`` (or a stop) ends training mid-epoch, Lightning's fit loop still runs
    the epoch's end (``on_advance_end``): it counts the epoch processed before
    ``on_train_epoch_end`` and completed before ``on_train_end``. A checkpoint taken from
    then on would resume at the next epoch, the rest of this one never trained; each such
    stop would count one epoch more, until a resume trained nothing."""
    loop = trainer.fit_loop
    progress = loop.epoch_progress.current
    return bool(
        progress.started > 0
        and progress.processed == progress.started
        and not loop.epoch_loop._num_ready_batches_reached()
    )


def epoch_in_progress(trainer: Any) -> int:
    """``trainer.current_epoch`` as a checkpoint of this moment resumes it: the epochs done,
    an epoch cut short (``epoch_cut_short``) not among them."""
    if epoch_cut_short(trainer):
        return int(trainer.fit_loop.epoch_progress.current.started) - 1
    return int(trainer.current_epoch)


def uncount_cut_epoch(checkpoint: dict[str, Any]) -> None:
    """Make a Lightning checkpoint taken after an epoch was cut short (``epoch_cut_short``)
    resume that epoch after its last batch run: its fit loop's epoch progress, current and
    total, back to mid-epoch (processed and completed one less than started, what the fit
    loop restores as ``RESTARTED_MID_EPOCH``), and its ``epoch`` the epochs done. The
    epoch loop's own state (the batch count) is already where that epoch stopped."""
    progress = checkpoint["loops"]["fit_loop"]["epoch_progress"]
    for counts in (progress["current"], progress["total"]):
        counts["processed"] = counts["completed"] = counts["started"] - 1
    checkpoint["epoch"] = progress["current"]["completed"]


def fsdp_strategy_class() -> type:
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
        def _setup_model(self, model: Module) -> Module:
            root = self._wrap(model)

            def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
                root.clip_grad_norm_(clip_val)  # a collective: every rank clips

            self.precision_plugin.clip_grad_by_norm = clip_grad_by_norm
            return root

        def _wrap(self, model: Module) -> Any:
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


def model_parallel_strategy_class(
    clip_norm: Callable[..., Any],
    clip_value: Callable[..., Any],
    pipeline: PipelineParts | None = None,
) -> type:
    """Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism on a
    (data_parallel, tensor_parallel) ``DeviceMesh``) under Ray Train, on CPU (gloo) or GPU;
    with ``pipeline``, on a (pipeline, data_parallel, tensor_parallel) mesh whose stages
    run ``pipeline``'s schedule as the training and validation steps.

    Ray Train starts the processes and their process group; the strategy builds its mesh on
    it. Lightning reads a rank's device as ``parallel_devices[local_rank]``, the devices
    ``Trainer(devices="auto")`` found in this process: one CPU under Ray, so local rank 1
    would index past it. Ray's strategies read the device from Ray Train, and so does this
    one. Every rank starts from rank 0's weights (``broadcast_state``). Lightning's
    precision plugin clips with ``torch.nn.utils``, which refuses
    parameters that mix DTensors and plain tensors (a model with tensor parallelism and no
    FSDP2); the strategy clips with ``clip_norm(parameters, max_norm, **stage)`` and
    ``clip_value(parameters, value)`` instead (``worker.grad_clip``'s, passed in: nothing
    here imports raytrain above ``errors``), ``stage`` saying, under a pipeline, which
    parameters this stage counts and the group its norm is summed over.

    Under a pipeline Lightning's loop is kept; only what a step computes changes: the
    model is cut to this rank's stage once the mesh exists (before ``configure_model``,
    which then shards just the stage; a model without one gets ``pipeline``'s FSDP2), the
    strategy's ``training_step`` and ``validation_step`` run the schedule, its
    ``backward`` only calls the hooks around a backward the schedule already ran, and its
    ``optimizer_step`` first sums the gradients of parameters several stages hold.
    """
    from raytrain._compat.model_parallel import RaytrainModelParallelStrategy

    parts = {
        "clip_norm": staticmethod(clip_norm),
        "clip_value": staticmethod(clip_value),
        "pipeline": pipeline,
    }
    return type("RaytrainModelParallelStrategy", (RaytrainModelParallelStrategy,), parts)
