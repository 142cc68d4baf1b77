"""Guards in the train loop that act on every rank at the same step.

``FiniteGuard``: stop a run whose loss or gradients stop being finite. ``PreemptionGuard``:
checkpoint within the grace window of a preemption notice (see its docstring).

``FiniteGuard`` runs in every worker's Lightning Trainer just before each optimizer step.
Under DDP the gradients it checks are already all-reduced, so a NaN or Inf on any rank is
seen by every rank at the same step, with no extra collective: all ranks raise
``NonFiniteLossError`` together, before the optimizer applies the step and before any
checkpoint of it. The driver's failure policy (``driver.failure_policy``) does not retry such a run:
a retry from the last checkpoint would replay the same batches to the same NaN.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Protocol

import lightning.pytorch as pl
import torch

from raytrain._compat.lightning import epoch_last_batch
from raytrain._compat.torch import grad_norms
from raytrain.errors import NonFiniteLossError
from raytrain.worker.grad_clip import local_shard

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch.optim import Optimizer


class FiniteGuard(pl.Callback):
    """Raises ``NonFiniteLossError`` when the gradients about to be applied are not finite."""

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        present = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if not present:
            return
        grads = [local_shard(g) for g in present]  # a DTensor's: this rank's part
        finite = bool(torch.isfinite(grad_norms(grads)).all())
        if any(g is not s for g, s in zip(present, grads, strict=True)):
            # sharded gradients (model parallelism): a NaN in one rank's part is not in the
            # others', so the ranks agree (one all-reduce of one float) and act together
            finite = _agreed(finite, grads[0].device)
        if finite:
            return
        step = trainer.global_step + 1
        raise NonFiniteLossError(
            f"the loss or its gradients became NaN/Inf at optimizer step {step} (epoch "
            f"{trainer.current_epoch + 1}); nothing of this step was applied or "
            f"checkpointed, and the run is not retried: a retry would replay the same batches"
        )


def _agreed(finite: bool, device: torch.device) -> bool:
    """Whether every rank's gradients are finite (a MIN all-reduce)."""
    import torch.distributed as dist

    flag = torch.tensor([1.0 if finite else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


class Checkpointer(Protocol):
    """What ``PreemptionGuard`` needs of the checkpoint callback
    (``worker.checkpointing.CheckpointCallback``)."""

    def checkpoint_now(self, trainer: pl.Trainer, kind: str) -> None:
        """Checkpoint this step and return once Ray Train's controller has taken it."""

    def defer_to_epoch_end(self, trainer: pl.Trainer) -> bool:
        """Whether a checkpoint asked for now is taken at the epoch's end instead (a train
        loader that keeps no position); it then is."""


# The notices, by the code the ranks all-reduce (MAX: a SIGTERM wins over the driver's
# request, which wins over a node drain).
NOTICES = (None, "node drain", "requested", "SIGTERM")
# The notices after which the run stops at its checkpoint (``PreemptedError``).
STOPPING = {"requested": "the driver was asked to stop (SIGUSR1)", "SIGTERM": "SIGTERM received"}


def _ends_here(trainer: pl.Trainer) -> bool:
    """Whether training ends with the epoch ending now (in ``on_train_epoch_end``): its
    last epoch, ``max_steps`` reached, or a callback (EarlyStopping) asked it to stop."""
    last_epoch = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= (
        trainer.max_epochs or 0
    )
    steps_done = trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps
    return bool(trainer.should_stop or last_epoch or steps_done)


class PreemptionGuard(pl.Callback):
    """Acts on a preemption notice (``raytrain.worker.preemption``) within its grace window.

    Every ``check_s`` seconds of training, at a step boundary, the ranks all-reduce whether
    any of them has a notice, so they act at the same step; the same all-reduce agrees on
    how many steps make the next interval. On a notice, ``checkpoints`` saves a checkpoint, and
    the guard waits until Ray Train has taken it (a taken checkpoint survives the worker
    group; an untaken one is dropped with it). After a node-drain notice training goes on:
    Ray Train restarts the run when the node goes. After a SIGTERM the process is going, so
    every rank raises ``PreemptedError`` and the run restarts from that checkpoint; after
    the driver's request (``"requested"``) too, and the run then stops there. A notice
    agreed at an epoch's last batch is acted on at that epoch's end, after its validation:
    a checkpoint taken in the last batch's ``on_train_batch_end`` resumes at the next epoch
    with the validation skipped and that epoch's steps never trained (as a step checkpoint
    there would, ``worker.checkpointing``); seen on a Slurm job preempted at step 207 of
    a 23-step epoch, which ended at step 345 of 368. So is any notice where the train
    loader keeps no position (its checkpoints are taken at epochs' ends). A run that ends
    with that epoch anyway is not stopped: it finishes (a stop would requeue a done run).
    """

    def __init__(self, checkpoints: Checkpointer, check_s: float = 1.0):
        self.checkpoints = checkpoints
        self.check_s = check_s
        self._next_check = 0
        self._since: tuple[int, float] = (0, 0.0)
        self._acted: str | None = None
        self._pending: str | None = None  # a notice agreed at an epoch's last batch
        self._pending_end = False  # acting on it, at the epoch's end
        self._last_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from raytrain.worker import preemption

        preemption.training(True)
        self._since = (trainer.global_step, time.perf_counter())
        self._next_check = trainer.global_step + 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from raytrain.worker import preemption

        preemption.training(False)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.on_train_end(trainer, pl_module)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        idx: int,
    ) -> None:
        step = trainer.global_step
        if step == self._last_step or step < self._next_check:  # accumulating, or not due
            return
        self._last_step = step
        kind = self._agreed_notice(trainer, step)
        if kind is None or kind == self._acted:
            return
        self._acted = kind
        # at the epoch's end instead: see the class docstring
        if epoch_last_batch(trainer) or self.checkpoints.defer_to_epoch_end(trainer):
            self._pending = kind
            return
        self._act(trainer, kind)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        kind, self._pending = self._pending, None
        if kind is not None:
            self._pending_end = True
            try:
                self._act(trainer, kind)
            finally:
                self._pending_end = False

    def _act(self, trainer: pl.Trainer, kind: str) -> None:
        step = trainer.global_step
        self.checkpoints.checkpoint_now(trainer, f"preemption ({kind})")
        # a run that ends at this epoch anyway finishes: stopping would requeue a done run
        if kind in STOPPING and not (self._pending_end and _ends_here(trainer)):
            from raytrain.errors import PreemptedError

            raise PreemptedError(
                f"preempted: {STOPPING[kind]}; checkpoint at step {step} committed, the run "
                "resumes from it"
            )

    def _agreed_notice(self, trainer: pl.Trainer, step: int) -> str | None:
        """The notice any rank has (SIGTERM first), and the next check's step, agreed."""
        from raytrain.worker import preemption

        steps, began = step - self._since[0], self._since[1]
        now = time.perf_counter()
        per_step = (now - began) / max(steps, 1)
        proposal = max(1, min(1000, math.ceil(self.check_s / max(per_step, 1e-6))))
        code = NOTICES.index(preemption.notice())
        # one all-reduce (MAX) agrees on the notice and on the smallest proposed interval
        device = trainer.strategy.root_device  # a GPU under NCCL
        values = torch.tensor([code, -proposal], dtype=torch.int64, device=device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        code, interval = int(values[0]), -int(values[1])
        self._since = (step, now)
        self._next_check = step + interval
        return NOTICES[code]
