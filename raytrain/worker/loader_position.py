"""Keeps a resumable train loader told where training is (see ``data.loaders``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

from raytrain._compat.lightning import set_epoch_length


class LoaderPosition(pl.Callback):
    """Keeps the train loader told where training is: which epoch starts (its shuffle order
    is (seed, epoch)) and how many of the epoch's batches have begun, which is the data
    position its ``state_dict`` saves in each checkpoint (Lightning's own batch count, so a
    prefetched batch is not counted as trained).

    ``loader`` returns the train loader: a user's DataModule makes it only once fit has
    started. A loader that keeps no position (a user's iterable one) is left alone."""

    def __init__(self, loader: Callable[[], Any]):
        self._loader = loader

    @property
    def loader(self) -> Any:
        loader = self._loader()
        return loader if hasattr(loader, "position") else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A restore mid-epoch skips on_train_epoch_start; the restored loader knows its epoch.
        if self.loader is not None:
            refit_epoch_length(trainer, self.loader)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = self.loader
        if loader is not None:
            loader.epoch = trainer.current_epoch
            refit_epoch_length(trainer, loader)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        loader = self.loader
        if loader is not None:
            loader.position = batch_idx + 1


def keeps_position(loader: object) -> bool:
    """Whether a restore mid-epoch resumes ``loader`` where it was: it has Lightning's
    loader protocol (``state_dict`` and ``load_state_dict``, which Lightning saves in
    checkpoints and restores), as raytrain's own loaders, a user's map-style loader once
    sharded, and a ``StatefulDataLoader`` do. Lightning restarts any other loader from its
    first batch while keeping the epoch's step count, so that a restore mid-epoch would
    train the epoch's first batches twice and (a sized loader) never its last ones."""
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


def refit_epoch_length(trainer: pl.Trainer, loader: Any) -> None:
    """Give Lightning this epoch's length when it differs from the one it read at setup.

    Lightning reads a loader's length once, when fit starts, and before it restores the
    loader's state. A loader restored mid-epoch reports that epoch's length (steps done
    plus steps left), which differs from a whole epoch's when the world size changed since
    the checkpoint (an elastic restart); later epochs are whole again. Lightning would end
    such epochs early (dropping rows) or validate at the wrong batch.
    """
    try:
        length = len(loader)
    except TypeError:  # a streamed set: Lightning runs each epoch to the end of the data
        return
    set_epoch_length(trainer, length)
