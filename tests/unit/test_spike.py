"""The spike guard on a real Trainer, and the rollback's skip on real Trainers over each of
raytrain's loaders, from each kind of restore (``worker.spike``); the whole path, with Ray
and a streamed Parquet set, runs in ``tests/integration/test_spike.py``."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from raytrain.data.loaders import ShardBatches
from raytrain.data.order import EpochSchedule, StreamSchedule
from raytrain.errors import LossSpikeError, LossSpikeLimitError
from raytrain.records.rollback_record import read_rollbacks
from raytrain.spec import SpikeSpec
from raytrain.worker.spike import SpikeGuard, _progress
from tests.unit.row_loaders import RowIndices


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

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, idx: int) -> Any:
            return self.layer(batch).sum() * 0 + losses[idx]

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        callbacks=[guard],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
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
    _fit_with(
        SpikeGuard(spec, str(tmp_path / "calm"), None, lambda: None),
        [1.0, 1.5, 0.5, 1.2, 0.8, 1.6, 0.9],
    )


# -- the skip, on real Trainers: 64 rows in order, 2 a batch; row 30's batch spikes ----------

ROWS, BATCH, POISON = 64, 2, 30


class _Stream(StreamSchedule):
    """A streamed set's schedule, planned at its first batch as ``ParquetStream`` is."""

    def __iter__(self) -> Any:
        _, block, sizes = self.plan()
        rows = [i for lo, hi in block for i in range(lo, hi)]
        for start, size in zip(itertools.accumulate([0, *sizes[:-1]]), sizes, strict=True):
            yield torch.tensor(rows[start : start + size], dtype=torch.float32).unsqueeze(1)


class _Shard:
    """A Ray Data shard's ``iter_batches``: the rows in order, as Arrow tables."""

    def iter_batches(self, batch_size: int, **_: Any) -> Any:
        import pyarrow as pa

        for lo in range(0, ROWS, batch_size):
            yield pa.table({"x": [[float(i)] for i in range(lo, lo + batch_size)]})


def _loader(kind: str) -> Any:
    if kind == "cached":
        return RowIndices(ROWS, BATCH, rank=0, world_size=1)
    if kind == "streamed":
        return _Stream(ROWS, BATCH, rank=0, world_size=1)
    return ShardBatches(_Shard(), BATCH)


def _train(
    loader: Any,
    callbacks: list[Any],
    trained: list[tuple[int, int]],
    spike_epoch: int,
    ckpt: str | None = None,
) -> None:
    """Two epochs; every row trained goes into ``trained`` as (epoch, row); the batch of row
    ``POISON`` spikes in ``spike_epoch``."""

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, idx: int) -> Any:
            x = (batch["x"] if isinstance(batch, dict) else batch).float()
            rows = [int(v) for v in x[:, 0]]
            trained.extend((self.current_epoch, r) for r in rows)
            spiked = POISON in rows and self.current_epoch == spike_epoch
            loss = 100.0 if spiked else 1.0 + ((rows[0] * 7919) % 13) / 130
            return self.layer(x).sum() * 0 + loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Model(), loader, ckpt_path=ckpt, weights_only=False)


class _Save(pl.Callback):
    """Saves one checkpoint: after batch ``at`` of epoch 0, or (None) at epoch 0's end."""

    def __init__(self, path: str, at: int | None):
        self.path, self.at = path, at

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.at is not None and (trainer.current_epoch, args[-1]) == (0, self.at):
            trainer.save_checkpoint(self.path)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.at is None and trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("kind", ["cached", "streamed", "ray_data"])
@pytest.mark.parametrize(
    ("spike_epoch", "saved_at"),
    [(0, 4), (1, None), (1, 20), (0, "none"), (1, "none")],
    ids=[
        "same-epoch",
        "epoch-end-then-next",
        "mid-epoch-then-next",
        "no-checkpoint",
        "no-checkpoint-next-epoch",
    ],
)
def test_a_restore_skips_exactly_to_the_spike_and_never_trains_it(
    kind: str, spike_epoch: int, saved_at: int | str | None, tmp_path: Path
) -> None:
    from raytrain.worker.loader_position import LoaderPosition
    from raytrain.worker.spike import RollbackSkip

    spec = SpikeSpec(threshold=8, window=5, max_rollbacks=3)
    ckpt = None if saved_at == "none" else str(tmp_path / "saved.ckpt")

    def callbacks(loader: Any, extra: list[Any]) -> list[Any]:
        return [
            SpikeGuard(spec, str(tmp_path), None, lambda: loader),
            *extra,
            LoaderPosition(lambda: loader),
            RollbackSkip(str(tmp_path), None, lambda: loader, None),
        ]

    loader = _loader(kind)
    saver = [] if ckpt is None else [_Save(ckpt, saved_at)]  # type: ignore[arg-type]
    with pytest.raises(LossSpikeError):
        _train(loader, callbacks(loader, saver), [], spike_epoch)
    (spike,) = read_rollbacks(str(tmp_path))
    assert (spike.epoch, spike.batch) == (spike_epoch, POISON // BATCH)

    restored: list[tuple[int, int]] = []
    loader = _loader(kind)
    # the poisoned batch would spike again: a restore that trained it would raise here
    _train(loader, callbacks(loader, []), restored, spike_epoch, ckpt=ckpt)
    by_epoch = {e: [r for ep, r in restored if ep == e] for e in (0, 1)}
    # the spike's epoch trains exactly the rows after the spiked batch, once each
    assert by_epoch[spike_epoch] == list(range(POISON + BATCH, ROWS))
    assert all(len(rows) == len(set(rows)) for rows in by_epoch.values())
    (done,) = read_rollbacks(str(tmp_path))
    assert done.rows_skipped is not None and done.restored_step is not None
