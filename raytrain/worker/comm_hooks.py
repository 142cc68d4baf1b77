"""Gradient compression: the DDP communication hook every gradient bucket goes through.

DDP all-reduces its gradient buckets through one communication hook per model. raytrain
registers it itself, on CPU (gloo) and GPU alike: Lightning registers its
``ddp_comm_hook`` only on CUDA, so on CPU workers a compression it is given is silently
not applied. The one hook (``gradient_hook``) does two things, each optional: it tells the
step timeline that a bucket's gradients are ready (the start of the gradients' wait), and
it sends the bucket as ``strategy.ddp.comm_hook`` asks (torch's own hooks: the fp32
all-reduce, fp16 or bf16 compression, PowerSGD), counting the bytes this rank sends.

PowerSGD keeps state between steps: the iteration (plain all-reduce until ``start_iter``)
and, per bucket, the low-rank factors it warm-starts from and the error it feeds back.
``Compression`` is a Lightning callback so that state goes into every checkpoint and
comes back on resume. Only rank 0 writes a DDP checkpoint, without waiting on the others
(``_compat.lightning.dump_state``), so what is saved is rank 0's: its iteration and its
factors, which are the same on every rank (both are all-reduced), and not the errors,
which differ by rank. A resume, on any number of workers, restores the iteration and the
factors on every rank, all-reduces plainly for 2 steps (while DDP rebuilds its buckets into
the layout the factors were made for) and restarts the error feedback at zero.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

if TYPE_CHECKING:
    import torch.distributed as dist
    from lightning.pytorch.utilities.types import STEP_OUTPUT
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    from raytrain.spec.sections import DdpSpec
    from raytrain.worker.step_timeline import StepTimeline


class HookState:
    """What DDP passes ``gradient_hook`` with each bucket: how to send it (``kind``, and
    PowerSGD's state), the step timeline to tell (None: none), and the bytes sent since
    ``take_bytes`` was last called."""

    def __init__(
        self, kind: str = "none", powersgd: Any = None, timeline: StepTimeline | None = None
    ) -> None:
        self.kind, self.powersgd, self.timeline = kind, powersgd, timeline
        self.sent = 0
        self.registered = False  # on the DDP model (by the step timeline or Compression)

    def send(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        buffer = bucket.buffer()
        if self.kind == "powersgd":
            state = self.powersgd
            before = state.total_numel_after_compression
            future = powerSGD_hook.powerSGD_hook(state, bucket)
            numbers = state.total_numel_after_compression - before or buffer.numel()
            self.sent += numbers * buffer.element_size()
            return future
        if self.kind in ("fp16", "bf16"):
            hook = (
                default_hooks.fp16_compress_hook
                if self.kind == "fp16"
                else (default_hooks.bf16_compress_hook)
            )
            self.sent += buffer.numel() * 2
            return hook(None, bucket)  # type: ignore[arg-type]  # None: the default group
        self.sent += buffer.numel() * buffer.element_size()
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    def take_bytes(self) -> int:
        sent, self.sent = self.sent, 0
        return sent


def gradient_hook(state, bucket):  # type: ignore[no-untyped-def]  # see below
    """The DDP communication hook: marks that a bucket's gradients are ready for the step
    timeline, then sends the bucket as ``state`` says. Not annotated: DDP refuses a hook
    whose annotations are not its own classes, and under ``from __future__ import
    annotations`` every annotation is a string."""
    if state.timeline is not None:
        state.timeline.grads_ready()
    return state.send(bucket)


def register(model: object, state: HookState) -> bool | None:
    """Register ``gradient_hook`` with ``state`` on DDP ``model``: True if it now sends
    the gradients, False if a hook of the user's strategy is there already, None if the
    model is not DDP."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return None
    try:
        model.register_comm_hook(state, gradient_hook)
    except RuntimeError:  # a hook of the user's strategy is there already
        return False
    state.registered = True
    return True


def powersgd_state(rank: int, start_iter: int) -> PowerSGDState:
    """PowerSGD's state for the default process group, as ``strategy.ddp.powersgd`` asks."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    return powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter
    )


class Compression(pl.Callback):
    """``strategy.ddp.comm_hook`` in a run: registers the hook at the start of training
    (unless the step timeline, given ``state``, registered it first), logs the bytes
    each step sent (``comm_bytes_per_step``), and keeps PowerSGD's state in checkpoints
    (see the module docstring)."""

    def __init__(self, ddp: DdpSpec) -> None:
        self.kind = ddp.comm_hook
        self.options = ddp.powersgd
        self.state = HookState(self.kind)
        self._restored: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.kind == "powersgd" and self.state.powersgd is None:
            self.state.powersgd = powersgd_state(self.options.rank, self.options.start_iter)
            if self._restored is not None:
                restore_powersgd(self.state.powersgd, self._restored, pl_module.device)
        if not self.state.registered:
            register(getattr(trainer.strategy, "model", None), self.state)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        i: int,
    ) -> None:
        sent = self.state.take_bytes()
        if sent:
            pl_module.log("comm_bytes_per_step", float(sent), on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        state = self.state.powersgd
        if state is None:
            return {}
        return {
            "iter": state.iter,
            "p": {k: v.detach().cpu() for k, v in state.p_memory_dict.items()},
            "q": {k: v.detach().cpu() for k, v in state.q_memory_dict.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = copy.copy(state_dict) or None


def restore_powersgd(state: PowerSGDState, saved: dict[str, Any], device: torch.device) -> None:
    """Put a saved iteration and low-rank factors into PowerSGD's ``state``, on
    ``device`` (the gradients'); the error feedback restarts at zero.

    A new DDP model starts with one bucket in parameter order and rebuilds its buckets
    after the first step; the saved factors are of the rebuilt ones (torch requires
    ``start_powerSGD_iter`` > 1 for this). So the resumed run all-reduces plainly for 2
    more steps, then compresses with the restored factors, which fit again."""
    state.iter = int(saved["iter"])
    state.start_powerSGD_iter = max(state.start_powerSGD_iter, state.iter + 2)
    state.p_memory_dict = {k: v.to(device) for k, v in saved["p"].items()}
    state.q_memory_dict = {k: v.to(device) for k, v in saved["q"].items()}
    state.error_dict = {}
