"""Loss spikes and the rollbacks past them (``failure.spike``): the score that finds a
spike, and the run's record of each rollback.

The ranks' side is ``worker.spike``; the driver's is ``driver.training`` (MLflow) and
``driver.failure_policy`` (a rollback is retried, a spent budget is not). This module needs
neither Lightning nor Ray, so both sides (and a unit test) share it.

The record is ``{run folder}/rollbacks.json``, a list with one entry per rollback, oldest
first. Rank 0 appends an entry when the ranks agree on a spike, before any rank raises; a
restored rank 0 completes it with the step it rolled back to and the rows it skipped. A
``--fresh`` run deletes it with the run folder.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from raytrain import storage

if TYPE_CHECKING:
    from raytrain.spec import StorageSpec

ROLLBACKS_FILE = "rollbacks.json"
# The median absolute deviation of normal data, times this, is its standard deviation.
MAD_TO_SD = 1.4826
# The least deviation a window is taken to have, as a share of its median's size.
RELATIVE_FLOOR = 0.01


def robust_z(window: Sequence[float], value: float) -> float:
    """How many (robust) standard deviations ``value`` lies above the median of ``window``:
    (value - median) / (1.4826 x the median absolute deviation). A loss curve's own descent
    and a few noisy batches barely move the median and the MAD, where a mean and standard
    deviation would be dragged by the spike itself. The deviation has a floor of 1% of the
    median's size (and 1e-12): a window whose values are mostly alike (a loss stuck at a
    value, a quantized one) would otherwise score any small rise a spike."""
    middle = statistics.median(window)
    mad = statistics.median(abs(x - middle) for x in window)
    return (value - middle) / max(MAD_TO_SD * mad, RELATIVE_FLOOR * abs(middle), 1e-12)


@dataclass(frozen=True)
class Rollback:
    """One rollback past a spike: where the spike was (the optimizer step being trained,
    the epoch, the batch of the epoch), its loss against the window's median and its
    score; ``position`` is the train loader's data position just after the spiked batch
    (its ``state_dict``: what a restore skips to). ``restored_step`` and ``rows_skipped``
    are filled in by the restore: the checkpoint's step and the rows it skipped per epoch
    position (over all ranks)."""

    step: int
    epoch: int
    batch: int
    loss: float
    median: float
    z: float
    window: int
    position: dict[str, Any] | None
    restored_step: int | None = None
    rows_skipped: int | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        line = (
            f"loss {self.loss:.4g} at step {self.step} (epoch {self.epoch}, batch "
            f"{self.batch}), {self.z:.1f} robust SDs over the median {self.median:.4g} of "
            f"the last {self.window} losses"
        )
        if self.restored_step is not None:
            line += f": rolled back to step {self.restored_step}"
            if self.rows_skipped is not None:
                line += f", {self.rows_skipped} rows skipped"
        return line

    def restored(self, step: int, rows: int | None, note: str | None = None) -> Rollback:
        return replace(
            self,
            restored_step=step,
            rows_skipped=rows,
            notes=[*self.notes, *([note] if note else [])],
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Rollback:
        return cls(**data)


def location(run_dir: str) -> str:
    return storage.join(run_dir, ROLLBACKS_FILE)


def read_rollbacks(run_dir: str, options: StorageSpec | None = None) -> list[Rollback]:
    """The run's rollbacks, oldest first; none when it never rolled back."""
    text = storage.read_text(location(run_dir), options)
    return [Rollback.from_json(entry) for entry in json.loads(text)] if text else []


def write_rollbacks(
    run_dir: str, rollbacks: Sequence[Rollback], options: StorageSpec | None = None
) -> None:
    """Replace the run's record (atomically: ``storage.write_text``)."""
    text = json.dumps([r.to_json() for r in rollbacks], indent=1)
    storage.write_text(location(run_dir), text, options)
