"""LightningModules for the integration tests: some fail on purpose, one records what it saw."""

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


class IdRecordingCNN(DigitsCNN):
    """Writes the ``id`` of every training row it sees, per rank and epoch, to ``out_dir``."""

    def __init__(self, out_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.out_dir = out_dir
        self._seen: list[int] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._seen.extend(int(i) for i in batch["id"])
        return super().training_step(batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        import json
        import os

        path = os.path.join(self.out_dir, f"rank{self.global_rank}-epoch{self.current_epoch}.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self._seen, handle)
        self._seen = []
