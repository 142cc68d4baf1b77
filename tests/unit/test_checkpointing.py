"""``worker.checkpointing.CheckpointCallback`` on a real Trainer, each checkpoint saved to a
local file where Ray's report would take it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from raytrain.contract import Report
from raytrain.worker.checkpointing import CheckpointCallback
from raytrain.worker.loader_position import LoaderPosition
from raytrain.worker.reporting import MetricsReporter
from raytrain.worker.schedule import CheckpointSchedule
from tests.unit.row_loaders import RowIndices

ROWS = 10


class _LocalCheckpoints(CheckpointCallback):
    """The callback, each checkpoint saved to ``folder`` instead of reported to Ray."""

    def __init__(
        self, folder: Path, schedule: CheckpointSchedule, loader: Any, publish: Any, **auto: Any
    ):
        reporter = MetricsReporter(log_every_n_steps=50, schedule=schedule, publish=publish)
        super().__init__(schedule=schedule, reporter=reporter, train_loader=lambda: loader, **auto)
        self.folder = folder
        self.saved: list[tuple[str, int, int]] = []  # (kind, step, the report's epoch)

    def _commit(self, trainer: pl.Trainer, metrics: dict[str, Any], upload: str) -> None:
        trainer.save_checkpoint(self.folder / f"{trainer.global_step}.ckpt")
        self.saved.append((metrics["kind"], trainer.global_step, metrics["epoch"]))


def _fit(
    folder: Path,
    max_steps: int,
    trained: list[tuple[int, int]],
    ckpt: Path | None,
    *,
    loader: Any = None,
    every_n_steps: int | None = None,
    events: list[Any] | None = None,
    auto: dict[str, Any] | None = None,
) -> Any:
    """Up to 3 epochs of ``ROWS`` one-row batches (a resumable loader unless ``loader``), or
    ``max_steps``; each row trained goes into ``trained`` as (epoch, row). With
    ``every_n_steps``, a checkpoint and a validation every that many steps, and rank 0's
    events into ``events``. ``auto``: the callback's ``auto`` and ``mtbf`` arguments."""

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, idx: int) -> Any:
            trained.extend((self.current_epoch, int(v)) for v in batch[:, 0])
            return self.layer(batch).sum()

        def validation_step(self, batch: Any, idx: int) -> None:
            self.log("val_loss", self.layer(batch).sum())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    loader = loader if loader is not None else RowIndices(ROWS, 1, rank=0, world_size=1)
    schedule = CheckpointSchedule(every_n_steps=every_n_steps, every_n_epochs=1)
    publish = None if events is None else events.append
    checkpoints = _LocalCheckpoints(folder, schedule, loader, publish, **(auto or {}))
    val = torch.utils.data.DataLoader(torch.ones(2, 1), batch_size=1) if every_n_steps else None
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=3,
        max_steps=max_steps,
        logger=False,
        callbacks=[LoaderPosition(lambda: loader), checkpoints.reporter, checkpoints],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=every_n_steps,
        limit_val_batches=2 if val else 0,
    )
    trainer.fit(Model(), loader, val, ckpt_path=ckpt, weights_only=False)
    return checkpoints.saved


def test_runs_ended_by_max_steps_mid_epoch_resume_each_row_once(tmp_path: Path) -> None:
    # Lightning counts an epoch that max_steps ends as done; saved so, a resume with more
    # steps started the next epoch (the rest of this one never trained), and each such stop
    # counted one epoch more until a resume trained nothing.
    trained: list[tuple[int, int]] = []
    saved = [_fit(tmp_path, 4, trained, None)]
    saved.append(_fit(tmp_path, 7, trained, tmp_path / "4.ckpt"))
    saved.append(_fit(tmp_path, -1, trained, tmp_path / "7.ckpt"))
    assert trained == [(epoch, row) for epoch in range(3) for row in range(ROWS)]
    # An epoch cut short is no epoch's end: no epoch checkpoint, and the end's report counts
    # only the epochs done.
    assert saved == [
        [("end", 4, 0)],
        [("end", 7, 0)],
        [("epoch", 10, 0), ("epoch", 20, 1), ("epoch", 30, 2)],
    ]
    final = torch.load(tmp_path / "30.ckpt", weights_only=False)
    assert (final["global_step"], final["epoch"]) == (30, 2)


def test_a_loader_that_keeps_no_position_resumes_a_cut_epoch_at_the_next(tmp_path: Path) -> None:
    # Lightning would start such a loader over mid-epoch, training its first rows twice:
    # as from any of its checkpoints, the resume starts the next epoch.
    rows = torch.arange(ROWS, dtype=torch.float32).unsqueeze(1)
    trained: list[tuple[int, int]] = []
    for steps, ckpt in ((4, None), (7, tmp_path / "4.ckpt")):
        loader = torch.utils.data.DataLoader(rows, batch_size=1)
        _fit(tmp_path, steps, trained, ckpt, loader=loader)
    assert trained == [(0, r) for r in range(4)] + [(1, r) for r in range(3)]


def test_a_validation_after_the_last_steps_checkpoint_is_reported_at_the_end(
    tmp_path: Path,
) -> None:
    # max_steps 4 ends epoch 0 at a step checkpoint, and a validation runs after it on
    # that batch: the cut epoch reports no epoch end, so the run's end reports it.
    events: list[Report] = []
    saved = _fit(tmp_path, 4, [], None, every_n_steps=2, events=events)
    assert saved == [("step", 2, 0), ("step", 4, 0)]
    last = events[-1]
    assert (last.kind, last.step, last.epoch) == ("end", 4, 0) and "val_loss" in last.metrics


def test_auto_chooses_the_interval_from_the_failure_rate_and_keeps_it_across_a_restore(
    tmp_path: Path,
) -> None:
    """``every_n_steps: auto`` on a real Trainer: after the first checkpoint (step 2 here,
    which measures a save), a run whose failures come every nanosecond checkpoints every
    step, one whose failures come once in 30,000 years never again within 30 steps; the
    interval is reported, and a restore keeps the interval and the step it counts from."""
    from raytrain.checkpoints.interval import AutoInterval

    def fit(folder: Path, mtbf: float, steps: int, ckpt: Path | None = None) -> Any:
        folder.mkdir(exist_ok=True)
        events: list[Report] = []
        auto = {"auto": AutoInterval(None), "mtbf": lambda: mtbf}
        saved = _fit(folder, steps, [], ckpt, every_n_steps=2, events=events, auto=auto)
        chosen = [e.checkpoint_interval for e in events if e.checkpoint_interval is not None]
        assert all("(measured)" in text and "sqrt(2 x save x MTBF)" in text for text in chosen)
        intervals = [
            e.metrics["checkpoint_interval"] for e in events if "checkpoint_interval" in e.metrics
        ]
        return saved, intervals, chosen

    often, intervals, chosen = fit(tmp_path / "often", 1e-9, 12)
    assert len(chosen) == 1  # 2 -> 1, said once
    # every step; step 10, an epoch's last batch, at the epoch's end (a state taken before
    # the epoch's end resumed into an epoch of no batches)
    assert [(kind, step) for kind, step, _ in often] == [
        ("step", 2),
        *(("step", s) for s in range(3, 10)),
        ("epoch", 10),
        ("step", 11),
        ("step", 12),
    ]
    assert set(intervals) == {1}
    rarely, intervals, chosen = fit(tmp_path / "rarely", 1e12, 30)
    assert len(chosen) == 1
    assert [(kind, step) for kind, step, _ in rarely] == [
        ("step", 2),
        ("epoch", 10),
        ("epoch", 20),
        ("epoch", 30),
    ]
    assert intervals and min(intervals) > 30
    # Restored from step 4 of the first run: its interval (1, from step 3) goes on at once,
    # before this run has measured anything of its own.
    again, _, chosen = fit(tmp_path / "often", 1e-9, 7, tmp_path / "often" / "4.ckpt")
    assert chosen == []
    assert [step for kind, step, _ in again if kind == "step"] == [5, 6, 7]
