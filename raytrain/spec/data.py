"""The ``data`` section: file sources read by Ray Data, or a LightningDataModule built in
each worker; absent, the model's own dataloaders feed it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, field_validator, model_validator

from raytrain.spec.classes import ClassSpec
from raytrain.spec.fields import _IMPORT_PATH, _check_location, _Section


class DataModuleSpec(ClassSpec):
    """A LightningDataModule that builds the data in each worker: ``prepare_data`` once per
    node, ``setup`` on every rank, then its loaders, sharded by raytrain."""


class SourceSpec(_Section):
    uri: str = Field(
        min_length=1, description="A file, or a folder/prefix of many files: path or URI."
    )

    @field_validator("uri")
    @classmethod
    def _location(cls, value: str) -> str:
        return _check_location(value)

    format: Literal["parquet", "csv", "json", "images"] = Field(
        default="parquet",
        description="The files' format; `images`: image files, decoded on Ray Data workers "
        "into an `image` column, with a `label` column when they sit in one folder per class.",
    )
    image_size: tuple[int, int] | None = Field(
        default=None, description="`images`: resize every image to [height, width]."
    )
    image_mode: str | None = Field(
        default=None, description="`images`: a Pillow mode to convert to (`RGB`, `L`, ...)."
    )

    @field_validator("image_size")
    @classmethod
    def _positive_size(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and min(value) < 1:
            raise ValueError(f"height and width must be >= 1, got {list(value)}")
        return value


class ShuffleSpec(_Section):
    seed: int = Field(default=0, description="Seed of the per-epoch shuffle of the train set.")
    buffer_size: int = Field(
        default=4096, ge=1, description="Rows held by each worker's local shuffle buffer."
    )


class DataSpec(_Section):
    train: SourceSpec = Field(description="The training set.")
    val: SourceSpec | None = Field(default=None, description="The validation set.")
    columns: list[str] | None = Field(
        default=None,
        min_length=1,
        description="Read only these columns (a projection); all when unset.",
    )
    batch_size: int = Field(default=64, ge=1, description="Rows per batch on each worker.")
    shuffle: ShuffleSpec | None = Field(
        default_factory=ShuffleSpec, description="Shuffle the train set each epoch; null: off."
    )
    preprocess: str | None = Field(
        default=None,
        pattern=_IMPORT_PATH,
        description="`module:function(batch) -> batch` over dicts of numpy arrays, run as a Ray "
        "Data `map_batches` step on CPU workers while the training actors train.",
    )
    cache: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Keep a split in the object store across epochs (`always`), stream it "
        "from storage every epoch (`never`), or `auto`: cache what fits the object-store "
        "budget unless it is images or preprocessed, which stream.",
    )
    prepare: str | None = Field(
        default=None,
        pattern=_IMPORT_PATH,
        description="`module:function(train_uri, val_uri)` that writes the data when the train "
        "set is missing (used by the bundled jobs to materialise their datasets).",
    )
    batch_format: Literal["dict", "tuple"] = Field(
        default="dict",
        description="A batch as a dict of tensors by column (`dict`), or a tuple of them in "
        "`columns` order (`tuple`, for steps that unpack `x, y = batch`).",
    )

    @model_validator(mode="after")
    def _tuple_needs_columns(self) -> DataSpec:
        if self.batch_format == "tuple" and not self.columns:
            raise ValueError("batch_format tuple needs `columns`: the order of the tuple")
        return self


def _data_kind(value: Any) -> str | None:
    """Which kind of `data` section a value is: a DataModule has a `class_path`."""
    if isinstance(value, dict):
        return "module" if "class_path" in value else "files"
    if isinstance(value, BaseModel):
        return "module" if isinstance(value, DataModuleSpec) else "files"
    return None


# `data`: file sources (read by Ray Data on the driver's cluster), a LightningDataModule, or
# absent: the model's own train_dataloader/val_dataloader.
Data = Annotated[
    Annotated[DataSpec, Tag("files")] | Annotated[DataModuleSpec, Tag("module")],
    Discriminator(_data_kind),
]
