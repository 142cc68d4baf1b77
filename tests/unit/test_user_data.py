"""Loaders from the user's code (``worker.user_data``): a DataLoader over a map-style
dataset sampled by raytrain across the ranks, every sample once per epoch, resumable
mid-epoch on another world size; iterable ones left alone; the hooks Lightning asks."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, WeightedRandomSampler

from raytrain.worker.loader_position import keeps_position
from raytrain.worker.user_data import ShardedLoader, UserData, shard

ROWS = 37


def _dataset() -> TensorDataset:
    return TensorDataset(torch.arange(ROWS), torch.arange(ROWS) * 10)


def _ids(batches: list[Any]) -> list[int]:
    return [int(i) for x, _ in batches for i in x]


def _epoch(loaders: list[Any], epoch: int) -> list[list[Any]]:
    for loader in loaders:
        loader.epoch = epoch
    return [list(loader) for loader in loaders]


def _loaders(world: int, **kwargs: Any) -> list[Any]:
    return [
        shard(
            DataLoader(_dataset(), batch_size=4, **kwargs),
            rank=r,
            world_size=world,
            seed=3,
            where="Data.train_dataloader",
        )
        for r in range(world)
    ]


def test_every_sample_once_per_epoch_by_one_rank_in_a_new_order_each_epoch() -> None:
    loaders = _loaders(2, shuffle=True)
    assert all(isinstance(loader, ShardedLoader) for loader in loaders)
    orders = []
    for epoch in range(3):
        per_rank = _epoch(loaders, epoch)
        assert len(per_rank[0]) == len(per_rank[1]) == len(loaders[0])  # DDP's equal steps
        seen = _ids(per_rank[0]) + _ids(per_rank[1])
        assert sorted(seen) == list(range(ROWS))
        orders.append(seen)
        # the user's collate function made the batches: (x, y) pairs as TensorDataset gives
        x, y = per_rank[0][0]
        assert torch.equal(y, x * 10)
    assert orders[0] != orders[1] != orders[2]
    assert orders == [
        _ids(r[0]) + _ids(r[1]) for r in (_epoch(_loaders(2, shuffle=True), e) for e in range(3))
    ]


def test_shuffle_false_keeps_the_datasets_order() -> None:
    (loader,) = _loaders(1, shuffle=False)
    assert _ids(list(loader)) == list(range(ROWS))


def test_a_restore_mid_epoch_on_another_world_size_trains_the_rest_once() -> None:
    two = _loaders(2, shuffle=True)
    for loader in two:
        loader.epoch = 1
    done = [list(loader)[:3] for loader in two]  # 3 steps of epoch 1 trained, then a loss
    for loader in two:
        loader.position = 3
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    (one,) = _loaders(1, shuffle=True)
    one.load_state_dict(state)
    rest = list(one)
    assert len(one) == 3 + len(rest)  # Lightning's restored count: steps done plus left
    trained = _ids(done[0]) + _ids(done[1]) + _ids(rest)
    assert sorted(trained) == list(range(ROWS))


def test_samplers_raytrain_cannot_shard_are_refused_naming_the_hook() -> None:
    weights = WeightedRandomSampler([1.0] * ROWS, ROWS)
    loader = DataLoader(_dataset(), batch_size=4, sampler=weights)
    with pytest.raises(ValueError, match=r"Data\.train_dataloader: .* WeightedRandomSampler"):
        shard(loader, rank=0, world_size=2, seed=0, where="Data.train_dataloader")
    with pytest.raises(ValueError, match=r"fewer samples than scaling\.num_workers"):
        shard(DataLoader(TensorDataset(torch.arange(1))), rank=0, world_size=2, seed=0, where="x")


class _Stream(IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(5))


def test_an_iterable_dataset_is_each_ranks_own_copy() -> None:
    loader = DataLoader(_Stream(), batch_size=2)
    assert shard(loader, rank=1, world_size=2, seed=0, where="x") is loader


class _StatefulLoader(DataLoader):
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_only_a_loader_with_lightnings_loader_protocol_resumes_mid_epoch() -> None:
    # (an iterable one without it is checkpointed at epoch ends: worker.checkpointing)
    assert keeps_position(_loaders(2)[0])
    assert keeps_position(_StatefulLoader(_Stream()))
    assert not keeps_position(DataLoader(_Stream(), batch_size=2))


class _Module(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_dataset(), batch_size=4, shuffle=True)


def test_the_hooks_lightning_asks_are_sharded_and_still_read_as_the_users() -> None:
    module = _Module()
    user = UserData(module, rank=0, world_size=2, seed=0)
    assert user.train_loader is None  # made when Lightning asks
    loader = module.train_dataloader()
    assert isinstance(loader, ShardedLoader) and user.train_loader is loader
    # Lightning calls a hook only where the user's class overrides it
    assert is_overridden("train_dataloader", module)
    assert not is_overridden("val_dataloader", module)
