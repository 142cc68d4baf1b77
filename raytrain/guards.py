"""Stop a run whose loss or gradients stop being finite, on every rank at the same step.

``FiniteGuard`` runs in every worker's Lightning Trainer just before each optimizer step.
Under DDP the gradients it checks are already all-reduced, so a NaN or Inf on any rank is
seen by every rank at the same step, with no extra collective: all ranks raise
``NonFiniteLossError`` together, before the optimizer applies the step and before any
checkpoint of it. The driver's failure policy (``ray_trainer``) does not retry such a run:
a retry from the last checkpoint would replay the same batches to the same NaN.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from raytrain.errors import NonFiniteLossError


class FiniteGuard(pl.Callback):
    """Raises ``NonFiniteLossError`` when the gradients about to be applied are not finite."""

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if not grads:
            return
        norms = torch.stack(torch._foreach_norm(grads))
        if bool(torch.isfinite(norms).all()):
            return
        step = trainer.global_step + 1
        raise NonFiniteLossError(
            f"the loss or its gradients became NaN/Inf at optimizer step {step} (epoch "
            f"{trainer.current_epoch + 1}); nothing of this step was applied or "
            f"checkpointed, and the run is not retried: a retry would replay the same batches"
        )
