"""When a worker checkpoints: a pure function of the step and epoch counts.

Both the checkpoint callback (which saves at these points) and the metrics reporter (which
publishes a plain metrics event at the other report points) read the same schedule, so a
step is reported exactly once: with its checkpoint, or on its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointSchedule:
    """``checkpoint.every_n_steps`` and ``every_n_epochs`` (None: never on that count)."""

    every_n_steps: int | None = None
    every_n_epochs: int | None = None

    def at_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` (Lightning's ``global_step`` after it) checkpoints."""
        return bool(self.every_n_steps) and step % (self.every_n_steps or 1) == 0

    def at_epoch(self, epochs_done: int) -> bool:
        """Whether the end of epoch number ``epochs_done`` (counting from 1) checkpoints."""
        return bool(self.every_n_epochs) and epochs_done % (self.every_n_epochs or 1) == 0
