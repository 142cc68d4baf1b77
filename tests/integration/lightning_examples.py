"""Lightning projects as Lightning's own examples write them, for the LightningCLI tests.

``Backbone`` and ``LitClassifier`` follow Lightning's
``examples/pytorch/basics/backbone_image_classifier.py``: the model takes its backbone as
an argument, which a LightningCLI config gives as a nested ``class_path`` block; here the
backbone's activation is a class too, so a config nests classes two levels deep, and its
output width is an argument (``num_classes``, 10 in Lightning's) for a link to set.
``write_mnist`` writes MNIST-shaped files where Lightning's ``MNISTDataModule`` reads them
under ``PL_USE_MOCKED_MNIST`` (nothing is downloaded). ``LinkedCLI`` links the DataModule's
``num_classes`` into the model's, as LightningCLI's docs show; ``BackboneCLI`` links
``MNISTClasses``' into the nested backbone's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.demos.mnist_datamodule import MNISTDataModule
from torch import nn
from torch.nn import functional as F


class Backbone(nn.Module):
    """Lightning's example backbone: two linear layers over a flattened 28x28 image."""

    def __init__(
        self, hidden_dim: int = 128, activation: nn.Module | None = None, num_classes: int = 10
    ) -> None:
        super().__init__()
        self.l1 = nn.Linear(28 * 28, hidden_dim)
        self.l2 = nn.Linear(hidden_dim, num_classes)
        self.activation = activation if activation is not None else nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.size(0), -1)
        return self.l2(self.activation(self.l1(x)))


class LitClassifier(pl.LightningModule):
    """Lightning's example ``LitClassifier``: the backbone is given, not built here."""

    def __init__(self, backbone: Backbone | None = None, learning_rate: float = 0.0001) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone if backbone is not None else Backbone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("valid_loss", F.cross_entropy(self(x), y), on_step=True, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


def write_mnist(data_dir: Path, train: int = 640, test: int = 64) -> None:
    """MNIST-shaped files (uint8 28x28 images, int64 labels) where ``MNISTDataModule``
    reads them with ``PL_USE_MOCKED_MNIST`` set: each class a bright band of its own rows
    over noise, so a model learns them in a few steps."""
    folder = data_dir / "MNIST" / "complete"
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    for name, count in (("training.pt", train), ("test.pt", test)):
        targets = torch.arange(count) % 10
        # small pixel values: _MNIST standardizes them as if they were 0-1 floats
        images = torch.randint(0, 2, (count, 28, 28), generator=generator)
        for label in range(10):
            images[targets == label, 2 * label + 4 : 2 * label + 7, :] = 3
        torch.save((images.to(torch.uint8), targets), folder / name)


class ClassesData(pl.LightningDataModule):
    """A DataModule that knows how many classes its data has (what a link reads)."""

    def __init__(self, num_classes: int = 3) -> None:
        super().__init__()
        self.num_classes = num_classes


class ClassesModel(pl.LightningModule):
    """A model whose head's width comes from the DataModule, through a link."""

    def __init__(self, num_classes: int, hidden: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.head = nn.Linear(hidden, num_classes)


class ExtraArgsModel(pl.LightningModule):
    """A model whose constructor takes ``**kwargs`` (what LightningCLI's ``dict_kwargs``
    gives)."""

    def __init__(self, width: int = 2, **kwargs: Any) -> None:
        super().__init__()
        self.width, self.extra = width, kwargs


class RefusingData(pl.LightningDataModule):
    """A DataModule whose constructor refuses a value its type allows."""

    def __init__(self, rows: int = 1) -> None:
        super().__init__()
        if rows <= 0:
            raise ValueError(f"rows must be positive, got {rows}")


class EveryEpochCheckpoint(ModelCheckpoint):
    """A project's own ModelCheckpoint subclass (what raytrain cannot honour)."""


class LinkedCLI(LightningCLI):
    """A project's CLI: ``data.num_classes`` → ``model.init_args.num_classes`` once the
    DataModule is built."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments(
            "data.num_classes", "model.init_args.num_classes", apply_on="instantiate"
        )


class MNISTClasses(MNISTDataModule):
    """Lightning's MNISTDataModule told how many classes its model's head should have
    (``num_classes`` is 10 in Lightning's; more leaves some never seen, which a test can
    tell from the backbone's default)."""

    def __init__(self, classes: int = 10, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.classes = classes

    @property
    def num_classes(self) -> int:
        return self.classes


class BackboneCLI(LightningCLI):
    """A project's CLI: the DataModule's ``num_classes`` → the nested backbone's, once the
    DataModule is built."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments(
            "data.num_classes",
            "model.init_args.backbone.init_args.num_classes",
            apply_on="instantiate",
        )
