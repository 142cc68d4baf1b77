"""The spike guard on a real Trainer, and the loader positions a rollback moves to
(``worker.spike``); the whole path runs in ``tests/integration/test_spike.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from raytrain.data.loaders import EpochSchedule
from raytrain.data.stream_order import StreamSchedule
from raytrain.errors import LossSpikeError, LossSpikeLimitError
from raytrain.rollback_record import read_rollbacks
from raytrain.spec import SpikeSpec
from raytrain.worker.spike import SpikeGuard, _progress


def _rows(schedule: Any) -> list[int]:
    """The rows (positions of the epoch's order) this rank's rest of the epoch holds."""
    if isinstance(schedule, EpochSchedule):
        return [int(i) for batch in schedule.index_batches() for i in batch]
    _, block, _ = schedule.plan()
    return [i for lo, hi in block for i in range(lo, hi)]


@pytest.mark.parametrize("kind", [EpochSchedule, StreamSchedule])
def test_a_spikes_position_with_the_checkpoints_step_count_resumes_after_the_spike(
    kind: type,
) -> None:
    def make() -> Any:
        return kind(1000, 8, rank=0, world_size=2)

    at_spike, at_checkpoint = make(), make()
    at_spike.position, at_checkpoint.position = 51, 40
    spike, checkpoint = at_spike.state_dict(), at_checkpoint.state_dict()
    assert _progress(checkpoint) < _progress(spike)

    restored = make()
    restored.load_state_dict({**spike, "steps": checkpoint["steps"]})
    after_spike = make()
    after_spike.load_state_dict(spike)
    # the rows after the spike, counted on from the checkpoint's step: 11 steps shorter
    assert _rows(restored) == _rows(after_spike)
    assert len(restored) == len(after_spike) - 11 == len(make()) - 11


def _fit_with(guard: SpikeGuard, losses: list[float]) -> None:
    """A single-process fit whose training_step returns ``losses`` in turn."""
    import lightning.pytorch as pl

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, idx: int) -> Any:
            return self.layer(batch).sum() * 0 + losses[idx]

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, callbacks=[guard],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)  # fmt: skip
    trainer.fit(Model(), torch.utils.data.DataLoader(torch.ones(len(losses), 1), batch_size=1))


def test_a_spike_is_recorded_then_stops_the_attempt_and_a_spent_budget_stops_the_run(
    tmp_path: Path,
) -> None:
    losses = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 9.0, 1.0]  # the 7th spikes
    spec = SpikeSpec(threshold=8, window=5, max_rollbacks=1)
    guard = SpikeGuard(spec, str(tmp_path), None, lambda: None)
    with pytest.raises(LossSpikeError, match=r"loss 9 at step 7 .*batch 6"):
        _fit_with(guard, losses)
    (spike,) = read_rollbacks(str(tmp_path))
    assert (spike.step, spike.batch, spike.loss, spike.window) == (7, 6, 9.0, 5)
    assert spike.z > 8 and spike.position is None  # this loader keeps no position
    assert guard.state_dict()["losses"] == pytest.approx(losses[1:6])  # kept in checkpoints

    # the same again with the budget spent: the run stops, the record is unchanged
    with pytest.raises(LossSpikeLimitError, match=r"max_rollbacks \(1\) spent"):
        _fit_with(SpikeGuard(spec, str(tmp_path), None, lambda: None), losses)
    assert len(read_rollbacks(str(tmp_path))) == 1
    # a rise the window's own noise makes usual is no spike
    _fit_with(SpikeGuard(spec, str(tmp_path / "calm"), None, lambda: None),
              [1.0, 1.5, 0.5, 1.2, 0.8, 1.6, 0.9])  # fmt: skip
