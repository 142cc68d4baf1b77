"""Data from the user's own code: a LightningDataModule (``data: {class_path, init_args}``)
or the model's ``train_dataloader``/``val_dataloader`` (no ``data`` section).

Lightning runs the DataModule as it always does: ``prepare_data`` once per node (local rank
0, then a barrier), ``setup`` on every rank, its hooks and its ``state_dict`` in
checkpoints. What raytrain changes is each loader Lightning asks for: a loader over a
map-style dataset becomes a ``ShardedLoader``, the same DataLoader (collate function,
worker processes, pinning) sampled by raytrain's ``EpochSchedule`` instead of its own
sampler. Every sample is then trained once per epoch, by one rank, in a (seed, epoch) order
when the loader shuffled (``shuffle=True``) and in the dataset's order when it did not; and
a restore resumes mid-epoch exactly, at any world size. A loader over an iterable dataset
is left as it is: each rank iterates its own copy. Under tensor parallelism the ranks of a
group must read the same rows: ranks and world size here are replicas
(``worker.strategy.data_rank``), and an iterable dataset, which shards itself by whatever
it reads, is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sized
from typing import TYPE_CHECKING, Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from raytrain.contract import WorkerConfig
from raytrain.data.loaders import worker_loaders
from raytrain.data.order import EpochSchedule
from raytrain.spec import DataSpec, JobSpec
from raytrain.spec.lightning_config import UserObjects

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.utils.data import Dataset

# What a ShardedLoader keeps of the user's DataLoader: how a batch is made and loaded.
KEPT = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
)


class ShardedLoader(DataLoader):
    """A user's DataLoader over a map-style dataset, sampled by ``EpochSchedule``: this
    rank's batches of a global (seed, epoch) order. It has the loader protocol that
    Lightning saves in checkpoints (``state_dict``/``load_state_dict``) and the ``epoch``
    and ``position`` that ``LoaderPosition`` keeps, all the schedule's."""

    def __init__(self, dataset: Dataset[Any], schedule: EpochSchedule, **kept: Any):
        super().__init__(dataset, batch_sampler=_ScheduleSampler(schedule), **kept)
        self.schedule = schedule

    @property
    def epoch(self) -> int:
        return self.schedule.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.schedule.epoch = value

    @property
    def position(self) -> int:
        return self.schedule.position

    @position.setter
    def position(self, value: int) -> None:
        self.schedule.position = value

    def state_dict(self) -> dict[str, int]:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.schedule.load_state_dict(state)


class _ScheduleSampler:
    """The schedule as a DataLoader's ``batch_sampler``: lists of dataset indices."""

    def __init__(self, schedule: EpochSchedule):
        self.schedule = schedule

    def __iter__(self) -> Iterator[list[int]]:
        for rows in self.schedule.index_batches():
            yield rows.tolist()

    def __len__(self) -> int:
        return len(self.schedule)


def shard(
    loader: object, *, rank: int, world_size: int, seed: int, where: str, tensor_parallel: int = 1
) -> object:
    """``loader`` as this rank's share: a ``ShardedLoader`` for a DataLoader over a
    map-style dataset; anything else as it is, but not under ``tensor_parallel`` > 1 (see
    the module docstring). ``where`` names the loader in errors
    (``MyData.train_dataloader``)."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        if tensor_parallel > 1:
            raise ValueError(
                f"{where}: not a DataLoader over a map-style dataset, which each worker would "
                "iterate as it is; with strategy.model_parallel.tensor_parallel_size "
                f"{tensor_parallel} the workers of a tensor-parallel group must read the same "
                "rows, which raytrain gives them from a map-style dataset (or from data files)"
            )
        return loader
    if isinstance(loader, ShardedLoader):
        return loader
    sampler, batch_size = loader.sampler, loader.batch_size
    if batch_size is None and type(loader.batch_sampler) is BatchSampler:
        sampler, batch_size = loader.batch_sampler.sampler, loader.batch_sampler.batch_size
    if batch_size is None or type(sampler) not in (RandomSampler, SequentialSampler):
        used = type(loader.batch_sampler if batch_size is None else sampler).__name__
        raise ValueError(
            f"{where}: its DataLoader samples with a {used}; raytrain shards a map-style "
            "dataset across the workers with its own sampler, so give the DataLoader "
            "batch_size and shuffle=True/False instead (or an IterableDataset, which each "
            "worker iterates as it is)"
        )
    if not isinstance(loader.dataset, Sized):
        raise ValueError(
            f"{where}: its map-style dataset has no __len__; raytrain's sampler "
            "needs the number of samples (or make it an IterableDataset)"
        )
    rows = len(loader.dataset)
    if rows < world_size:
        raise ValueError(
            f"{where}: {rows} samples cannot give each of {world_size} workers "
            "a batch (fewer samples than scaling.num_workers)"
        )
    shuffled = type(sampler) is RandomSampler
    schedule = EpochSchedule(
        rows, batch_size, rank=rank, world_size=world_size, shuffle_seed=seed if shuffled else None
    )
    kept = {name: getattr(loader, name) for name in KEPT}
    if not kept["num_workers"]:
        kept.pop("prefetch_factor")  # torch refuses it without worker processes
    return ShardedLoader(loader.dataset, schedule, **kept)


class UserData:
    """Routes the loaders Lightning asks of ``source`` (a DataModule, or the model) through
    ``shard``, and keeps the train loader for ``LoaderPosition``.

    Lightning asks by hook name (``train_dataloader()``), so the hooks are wrapped on this
    instance: its class, and with it everything Lightning reads of it, is the user's."""

    def __init__(
        self,
        source: pl.LightningDataModule | pl.LightningModule,
        *,
        rank: int,
        world_size: int,
        seed: int,
        tensor_parallel: int = 1,
    ):
        self.source = source
        self.train_loader: Any = None
        owner = type(source).__name__
        for hook in ("train_dataloader", "val_dataloader"):
            original = getattr(source, hook)

            @functools.wraps(original)
            def sharded(original: Callable[[], object] = original, hook: str = hook) -> object:
                loader = shard(
                    original(),
                    rank=rank,
                    world_size=world_size,
                    seed=seed,
                    where=f"{owner}.{hook}",
                    tensor_parallel=tensor_parallel,
                )
                if hook == "train_dataloader":
                    self.train_loader = loader
                return loader

            setattr(source, hook, sharded)


def worker_data(
    spec: JobSpec, work: WorkerConfig, user: UserObjects, rank: int, world_size: int
) -> tuple[Callable[[], Any], dict[str, Any]]:
    """This worker's data for ``trainer.fit`` (``rank`` and ``world_size``: its replica's,
    ``worker.strategy.data_rank``): a function returning the train loader (for
    ``LoaderPosition``; a DataModule's exists only once fit asks for it) and ``fit``'s
    data arguments: file loaders, the DataModule, or none (the model's own loaders).
    ``user``: the config's model and DataModule, built."""
    if isinstance(spec.data, DataSpec):
        train, val = worker_loaders(
            spec.data, work.cached, work.streamed, work.mixed, spec.storage, rank, world_size
        )
        return (lambda: train), {"train_dataloaders": train, "val_dataloaders": val}

    seed = 0 if spec.trainer.seed is None else spec.trainer.seed
    tp = spec.strategy.replica_size
    if spec.data is None:
        own = UserData(user.model, rank=rank, world_size=world_size, seed=seed, tensor_parallel=tp)
        return (lambda: own.train_loader), {}
    datamodule = user.datamodule
    own = UserData(datamodule, rank=rank, world_size=world_size, seed=seed, tensor_parallel=tp)
    return (lambda: own.train_loader), {"datamodule": datamodule}
