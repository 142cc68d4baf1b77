"""When a worker checkpoints: a function of the step and epoch counts, and of the step the
current step interval began at.

Both the checkpoint callback (which saves at these points) and the metrics reporter (which
publishes a plain metrics event at the other report points) read the same schedule, so a
step is reported exactly once: with its checkpoint, or on its own. Under
``checkpoint.every_n_steps: auto`` the interval changes at a checkpoint (``retune``),
every rank alike, and the next checkpoint counts from there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointSchedule:
    """``checkpoint.every_n_steps`` and ``every_n_epochs`` (None: never on that count);
    ``anchor``: the step the step interval counts from (0, unless retuned)."""

    every_n_steps: int | None = None
    every_n_epochs: int | None = None
    anchor: int = 0

    def at_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` (Lightning's ``global_step`` after it) checkpoints:
        every ``every_n_steps`` steps after ``anchor``."""
        n = self.every_n_steps
        return bool(n) and step > self.anchor and (step - self.anchor) % (n or 1) == 0

    def at_epoch(self, epochs_done: int) -> bool:
        """Whether the end of epoch number ``epochs_done`` (counting from 1) checkpoints."""
        return bool(self.every_n_epochs) and epochs_done % (self.every_n_epochs or 1) == 0

    def retune(self, step: int, every_n_steps: int) -> None:
        """Checkpoint every ``every_n_steps`` steps from ``step`` (a checkpoint's) on."""
        self.every_n_steps, self.anchor = every_n_steps, step
