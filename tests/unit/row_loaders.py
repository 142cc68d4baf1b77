"""A resumable train loader for tests on a real Trainer: each batch is its rows' indices."""

from __future__ import annotations

from typing import Any

import torch

from raytrain.data.order import EpochSchedule


class RowIndices(EpochSchedule):
    """A cached set's schedule, its rows' indices as the batch (one float column)."""

    def __iter__(self) -> Any:
        for rows in self.index_batches():
            yield torch.tensor(rows, dtype=torch.float32).unsqueeze(1)
