"""``scaling.keep_global_batch``: the accumulation each worker count gets, and optimizer
steps that take whole accumulations after a restore that changed it (on a real Trainer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from raytrain.spec import JobSpec
from raytrain.spec.global_batch import accumulation, global_batch
from tests.conftest import digits_spec


def test_the_accumulation_is_the_nearest_to_the_target_and_exact_where_it_divides() -> None:
    for target in range(1, 25):
        for world in range(1, 9):
            got = accumulation(target, world)
            best = min(abs(target - a * world) for a in range(1, target + 2))
            assert got >= 1 and abs(target - got * world) == best, (target, world, got)
            if target % world == 0:
                assert got * world == target
            # a tie goes to the smaller global batch
            assert got == 1 or abs(target - (got - 1) * world) > best, (target, world, got)


def test_a_spec_keeps_the_global_batch_of_its_most_workers(tmp_path: Path) -> None:
    scaling = {"num_workers": [1, 4], "keep_global_batch": True}
    spec = digits_spec(
        tmp_path,
        tmp_path,
        scaling=scaling,
        trainer={"accumulate_grad_batches": 2},
        data={"batch_size": 8},
    )
    job = JobSpec.model_validate(spec)
    plans = {w: global_batch(job, w) for w in (1, 2, 3, 4)}
    assert {w: p.accumulate for w, p in plans.items()} == {1: 8, 2: 4, 3: 3, 4: 2}
    assert {w: p.samples for w, p in plans.items()} == {1: 64, 2: 64, 3: 72, 4: 64}
    assert [w for w, p in plans.items() if not p.exact] == [3]
    assert "nearest" in plans[3].describe() and "global batch 72" in plans[3].describe()
    # without it, the spec's accumulation on any worker count
    job = job.model_copy(
        update={"scaling": job.scaling.model_copy(update={"keep_global_batch": False})}
    )
    assert global_batch(job, 1).accumulate == 2 and global_batch(job, 1).samples == 16


def test_keep_global_batch_is_bounded_on_the_fewest_workers(tmp_path: Path) -> None:
    """An elastic [1, 1e9] with keep_global_batch once passed validate: a billion batches a
    step on one worker. The accumulation on the fewest workers is bounded by the limit of
    trainer.accumulate_grad_batches, the field named, the arithmetic said."""
    from raytrain.errors import SpecError
    from raytrain.spec import MAX_ACCUMULATION, parse_spec
    from raytrain.spec.global_batch import fewest_workers_batch

    def spec(low: int, high: int, accumulate: int = 1) -> dict:
        scaling = {"num_workers": [low, high], "keep_global_batch": True}
        trainer = {"accumulate_grad_batches": accumulate}
        return digits_spec(tmp_path, tmp_path, trainer=trainer, scaling=scaling)

    assert fewest_workers_batch(parse_spec(spec(1, 1024))).accumulate == MAX_ACCUMULATION
    assert fewest_workers_batch(parse_spec(spec(4, 64, 64))).accumulate == 1024
    for low, high, accumulate in ((1, 1025, 1), (2, 16, 200), (1, 10_000, 1)):
        with pytest.raises(SpecError) as caught:
            parse_spec(spec(low, high, accumulate))
        (line,) = caught.value.problems
        assert line.startswith(
            f"scaling.num_workers: [{low}, {high}] with scaling.keep_global_batch: global batch "
        ), line
        assert f"more than the limit of {MAX_ACCUMULATION} batches a step" in line, line
    no_keep = spec(1, 10_000)
    no_keep["scaling"]["keep_global_batch"] = False  # the global batch follows the workers
    assert fewest_workers_batch(parse_spec(no_keep)).accumulate == 1


class _Loader:
    """Six batches, resumable at a batch (Lightning's loader protocol)."""

    def __init__(self) -> None:
        self.position, self._start = 0, 0

    def __len__(self) -> int:
        return 6

    def __iter__(self) -> Any:
        start, self._start = self._start, 0
        for i in range(start, 6):
            yield torch.full((1, 2), float(i))

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._start = state["position"]


def _fit(
    accumulate: int, callbacks: list[Any], ckpt: str | None = None, save_at: str | None = None
) -> list[tuple[int, int]]:
    """(epoch, batch) of every batch trained, each with the optimizer step it went into."""
    import lightning.pytorch as pl

    loader = _Loader()
    steps: list[tuple[int, int]] = []

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, idx: int) -> Any:
            steps.append((self.current_epoch, self.global_step))
            return self.layer(batch).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Track(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            loader.position = args[-1] + 1

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if save_at and trainer.global_step == 3 and trainer.current_epoch == 0:
                trainer.save_checkpoint(save_at)  # mid-epoch, after 3 batches

    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulate,
        callbacks=[Track(), *callbacks],
    )
    trainer.fit(Model(), loader, ckpt_path=ckpt, weights_only=False)
    return steps


def _batches_per_step(steps: list[tuple[int, int]]) -> list[int]:
    counts: dict[tuple[int, int], int] = {}
    for key in steps:
        counts[key] = counts.get(key, 0) + 1
    return list(counts.values())


def test_a_restore_with_another_accumulation_steps_on_whole_accumulations(tmp_path: Path) -> None:
    from raytrain.worker.accumulation import AccumulationAlignment

    ckpt = str(tmp_path / "mid.ckpt")
    _fit(1, [], save_at=ckpt)
    # Lightning alone: restored after batch 3 with an accumulation of 2, batch 4 steps alone
    assert _batches_per_step(_fit(2, [], ckpt=ckpt))[0] == 1
    aligned = _fit(2, [AccumulationAlignment()], ckpt=ckpt)
    # epoch 0's batches 4-5 and 6 (its last batch steps alone, as Lightning's own epochs
    # end); epoch 1 counts from its start: 3 steps of 2
    assert _batches_per_step(aligned) == [2, 1, 2, 2, 2]
    # a run that never restored is unchanged
    assert _batches_per_step(_fit(2, [AccumulationAlignment()])) == [2, 2, 2, 2, 2, 2]
