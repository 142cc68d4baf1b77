"""Step timing shared by the raytrain side and the hand-written DDP side of the benchmarks.

Both record, on rank 0, wall-clock times of each epoch start and each optimizer step's end,
so both sides are measured by the same definitions (see ``summarize``).
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from typing import Any

import lightning.pytorch as pl

from raytrain.models.digits import DigitsCNN

# The two benchmark models: the default job's CNN, and a wider one whose step takes >= 50 ms
# on a 2-core machine (compute-bound: framework overhead per step is small beside it).
MODELS: dict[str, dict[str, Any]] = {
    "digits": {"init_args": {"lr": 0.002, "channels": 16, "hidden": 64}, "batch_size": 32},
    "compute": {"init_args": {"lr": 0.001, "channels": 96, "hidden": 512}, "batch_size": 128},
}
WARMUP_STEPS = 5


class StepClock:
    """Collects epoch-start and step-end times; ``dump`` writes them as JSON."""

    def __init__(self) -> None:
        self.epoch_starts: list[float] = []
        self.step_ends: list[list[float]] = []
        self.train_end: float | None = None

    def epoch_start(self) -> None:
        self.epoch_starts.append(time.time())
        self.step_ends.append([])

    def step_end(self) -> None:
        self.step_ends[-1].append(time.time())

    def end(self) -> None:
        self.train_end = time.time()

    def dump(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(
                {
                    "epoch_starts": self.epoch_starts,
                    "step_ends": self.step_ends,
                    "train_end": self.train_end,
                },
                handle,
            )


class _ClockCallback(pl.Callback):
    def __init__(self, path: str):
        self.path = path
        self.clock = StepClock()
        self._last_step = -1

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock.epoch_start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            self.clock.step_end()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.clock.end()
        if trainer.global_rank == 0:
            self.clock.dump(self.path)


class TimedDigitsCNN(DigitsCNN):
    """``DigitsCNN`` that records rank 0's step times into ``timing_path``."""

    def __init__(self, timing_path: str, **kwargs: Any):
        super().__init__(**kwargs)
        self._timing_path = timing_path

    def configure_callbacks(self) -> list[pl.Callback]:
        return [_ClockCallback(self._timing_path)]


def summarize(timing: dict[str, Any], launched_at: float) -> dict[str, float]:
    """Per-step, startup, per-epoch and end-to-end figures from one run's clock.

    - step: median of step-to-step intervals within epochs, after ``WARMUP_STEPS``;
    - startup: from launching the command to the end of the first step;
    - epoch_overhead: median over epochs after the first of
      (epoch start to next epoch start, or to the end) minus steps x step;
    - wall: from launch to the end of training.
    """
    starts, steps = timing["epoch_starts"], timing["step_ends"]
    intervals = []
    seen = 0
    for epoch_steps in steps:
        for a, b in itertools.pairwise(epoch_steps):
            seen += 1
            if seen > WARMUP_STEPS:
                intervals.append(b - a)
    step = statistics.median(intervals)
    ends = [*starts[1:], timing["train_end"]]
    overheads = [
        (end - start) - len(epoch_steps) * step
        for start, end, epoch_steps in zip(starts, ends, steps, strict=True)
    ][1:]
    first_step = next(s[0] for s in steps if s)
    return {
        "step_s": step,
        "startup_s": first_step - launched_at,
        "epoch_overhead_s": statistics.median(overheads) if overheads else float("nan"),
        "wall_s": timing["train_end"] - launched_at,
        "steps": sum(len(s) for s in steps),
    }


class DigitsParquetModule(pl.LightningDataModule):
    """The benchmark's Parquet splits as a LightningDataModule, as a user would write one:
    ``TensorDataset``s of dict-free ``(pixels, label)`` rows read once in ``setup``, batched
    by DataLoaders with the default collate. ``TimedDigitsTupleCNN`` reads them."""

    def __init__(self, train: str, val: str, batch_size: int):
        super().__init__()
        self.train_uri, self.val_uri, self.batch_size = train, val, batch_size

    @staticmethod
    def _rows(uri: str) -> Any:
        import pyarrow.parquet as pq
        import torch
        from torch.utils.data import TensorDataset

        table = pq.read_table(uri, columns=["pixels", "label"])
        pixels = torch.tensor(table.column("pixels").to_pylist(), dtype=torch.float32)
        return TensorDataset(pixels, torch.tensor(table.column("label").to_pylist()))

    def setup(self, stage: str) -> None:
        self.train, self.val = self._rows(self.train_uri), self._rows(self.val_uri)

    def train_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(self.val, batch_size=self.batch_size)


class TimedDigitsTupleCNN(TimedDigitsCNN):
    """``TimedDigitsCNN`` for ``(pixels, label)`` batches (a DataModule's, or
    ``data.batch_format: tuple``)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return super().training_step({"pixels": batch[0], "label": batch[1]}, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step({"pixels": batch[0], "label": batch[1]}, batch_idx)
