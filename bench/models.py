"""Models for the benchmarks beyond bench/timed.py's."""

from __future__ import annotations

import torch

from raytrain.models.digits import DigitsCNN


class BigCheckpointCNN(DigitsCNN):
    """The digits CNN carrying ``state_mb`` MB of frozen weights: its checkpoint is that big,
    while a step costs what the digits CNN's does (frozen weights get no gradient, and DDP
    syncs them once, at the start)."""

    def __init__(self, state_mb: int = 200, **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.frozen = torch.nn.Parameter(torch.zeros(state_mb * 2**20 // 4), requires_grad=False)
