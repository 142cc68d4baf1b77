"""LightningModules that misbehave on purpose, for the failure-path tests."""

from __future__ import annotations

import torch

from raytrain.models.digits import DigitsCNN


class ExplodingCNN(DigitsCNN):
    """Raises from ``training_step`` on rank ``rank`` once ``global_step`` reaches ``at_step``."""

    def __init__(self, at_step: int = 3, rank: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.at_step = at_step
        self.fail_rank = rank

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step >= self.at_step and self.global_rank == self.fail_rank:
            raise ValueError(f"boom at step {self.global_step} on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)
